"""DATA.DECODER draft: JPEGs decoded at a reduced DCT scale where the crop allows, with the crop
geometry and random stream of the full decode."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from helpers import truncated_jpeg
from PIL import Image

from distribuuuu.config import get_cfg_defaults
from distribuuuu.data.datasets import seeded_cpu_rng
from distribuuuu.data.draft import decode_reduced
from distribuuuu.data.encoded import decode_image_bytes, load_image
from distribuuuu.data.errors import BadImageError
from distribuuuu.training.preprocessing import build_train_transform, build_val_transform


def _photo(width: int, height: int) -> bytes:
    """A smooth photo-like JPEG (a coarse random field, upsampled): DCT scaling barely changes it."""
    coarse = np.random.default_rng(0).integers(0, 256, (height // 50 + 1, width // 50 + 1, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(coarse).resize((width, height), Image.BICUBIC).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_reduction_is_the_largest_that_keeps_the_crop_at_least_the_output():
    data = _photo(2000, 1500)
    cases = ((1800, 224, (250, 188)), (1000, 224, (500, 375)), (600, 224, (1000, 750)), (400, 224, (2000, 1500)))
    for min_side, target, size in cases:
        image, r = decode_reduced(decode_image_bytes(data, "p.jpg", "draft"), min_side, target)
        assert image.size == size and r == pytest.approx(2000 / size[0]) and image.mode == "RGB"


@pytest.mark.parametrize("im_size", [32, 224])
def test_draft_crops_like_the_full_decode_and_draws_the_same_random_numbers(im_size):
    cfg = get_cfg_defaults()
    cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE, cfg.TEST.CROP_SIZE = im_size, im_size, im_size
    data = _photo(1600, 1200)
    out = {}
    for decoder in ("pil", "draft"):
        cfg.DATA.DECODER = decoder
        train = build_train_transform(cfg)
        with seeded_cpu_rng(5):
            image = train(decode_image_bytes(data, "p.jpg", decoder))
            after = torch.rand(4)  # the stream continues where the full decode's does
        out[decoder] = image, after, build_val_transform(cfg)(decode_image_bytes(data, "p.jpg", decoder))
    (a, ra, va), (b, rb, vb) = out["pil"], out["draft"]
    assert a.shape == b.shape == (3, im_size, im_size) and torch.equal(ra, rb)
    # Same crop, slightly different pixels (DCT scaling vs antialiased resize), in normalised units.
    assert (a - b).abs().mean() < 0.1 and (va - vb).abs().mean() < 0.1


def test_draft_names_a_truncated_jpeg(tmp_path):
    cfg = get_cfg_defaults()
    cfg.DATA.DECODER = "draft"
    path = str(truncated_jpeg(tmp_path / "bad.jpg"))
    with pytest.raises(BadImageError, match="bad.jpg"):
        build_train_transform(cfg)(load_image(path, "draft"))
