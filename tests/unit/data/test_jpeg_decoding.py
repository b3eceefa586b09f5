"""DATA.DECODER "auto" keeps decoding JPEGs when torchvision's deprecated decoders are gone: with
TorchCodec where installed, else with PIL, to the pixels PIL gives."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch
import torchvision
from helpers import REPO
from PIL import Image

from distribuuuu.data import jpeg, load_image

# Every decoder here wraps libjpeg-turbo with its default integer IDCT and fancy upsampling: the
# pixels are equal (measured max difference 0). Two levels leave room for another libjpeg build:
# JPEG conformance (ITU-T T.83) lets each IDCT output sample differ by one, and the chroma
# upsampling by about as much again.
TOLERANCE = 2


def _jpegs(tmp_path) -> list:
    """A digit and a 500x375 photo-like image (gradients and noise), saved as JPEGs."""
    digit = tmp_path / "digit.jpg"
    Image.open(next((REPO / "data" / "digits" / "train" / "7").glob("*.png"))).convert("RGB").save(digit, quality=90)
    y, x = np.mgrid[0:375, 0:500]
    photo = np.stack([x % 256, (2 * y) % 256, ((x + y) // 3) % 256], -1) + np.random.default_rng(0).normal(
        0, 20, (375, 500, 3)
    )
    Image.fromarray(np.clip(photo, 0, 255).astype(np.uint8)).save(tmp_path / "photo.jpg", quality=90)
    return [digit, tmp_path / "photo.jpg"]


def _without_torchvision_decoders(monkeypatch) -> None:
    for name in ("decode_jpeg", "decode_image"):
        monkeypatch.delattr(torchvision.io, name, raising=False)


@pytest.mark.parametrize("torchcodec", [True, False], ids=["torchcodec", "pil"])
def test_auto_decodes_jpegs_like_pil_without_torchvision_decoders(tmp_path, monkeypatch, torchcodec):
    if torchcodec:
        pytest.importorskip("torchcodec")
    else:
        monkeypatch.setitem(sys.modules, "torchcodec", None)
        monkeypatch.setattr(jpeg, "_torchcodec_decoders", lambda: None)
    _without_torchvision_decoders(monkeypatch)
    assert jpeg.jpeg_library() == ("torchcodec" if torchcodec else None)
    for path in _jpegs(tmp_path):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            image = load_image(str(path))
        pixels = torch.as_tensor(np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image))
        if not isinstance(image, Image.Image):
            pixels = pixels.permute(1, 2, 0)  # tv_tensors.Image is CHW
        expected = torch.as_tensor(np.asarray(Image.open(path).convert("RGB")))
        assert pixels.shape == expected.shape
        assert (pixels.int() - expected.int()).abs().max() <= TOLERANCE, path
        assert not [w for w in caught if "deprecat" in str(w.message).lower()], [str(w.message) for w in caught]


def test_auto_with_torchcodec_does_not_call_torchvision_decoders(tmp_path, monkeypatch):
    pytest.importorskip("torchcodec")

    def deprecated(*args, **kwargs):
        raise AssertionError("torchvision's deprecated decoder was called")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", deprecated)
    monkeypatch.setattr(torchvision.io, "decode_image", deprecated)
    assert jpeg.jpeg_library() == "torchcodec"
    assert load_image(str(_jpegs(tmp_path)[0])).shape[0] == 3
