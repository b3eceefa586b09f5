"""DATA.MAX_IMAGE_PIXELS: an image whose header declares more pixels than the limit is refused by
every decoder before anything is decoded (a 3 KB JPEG declaring 20000x20000 pixels would decode to
1.2 GB), with one line naming the file; DATA.BAD_IMAGE skip skips and counts it."""

from __future__ import annotations

import io
import re
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torchvision
from helpers import FAST_ARCH, REPO, TRAIN, assert_ok, in_process, read_metrics
from PIL import Image

from distribuuuu.config import ConfigError, get_cfg_defaults, load_cfg
from distribuuuu.data import BadImageError, jpeg, load_image
from distribuuuu.data.encoded import decode_image_bytes
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS, ImageTooLargeError, open_image
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split

DIGITS = REPO / "data" / "digits"
BOMB_SIDE = 20000  # 400,000,000 pixels: 1.2 GB of RGB once decoded
REFUSED = "image too large: {path} declares {w}x{h} pixels ({pixels} > DATA.MAX_IMAGE_PIXELS {limit})"

pytestmark = pytest.mark.usefixtures("plain_logging")


def _noise(width: int = 64, height: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def declaring_jpeg(width: int, height: int, progressive: bool = False) -> bytes:
    """A 64x64 JPEG whose frame header (SOF0, or SOF2 when ``progressive``) says width x height."""
    buf = io.BytesIO()
    _noise().save(buf, "JPEG", quality=75, progressive=progressive)
    data = bytearray(buf.getvalue())
    at = 2  # past SOI: walk the marker segments to the frame header
    while data[at + 1] not in (0xC0, 0xC2):
        at += 2 + struct.unpack(">H", data[at + 2 : at + 4])[0]
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def declaring_png(width: int, height: int) -> bytes:
    """A 64x64 PNG whose IHDR chunk says width x height (its CRC rewritten, so it is a valid header)."""
    buf = io.BytesIO()
    _noise().save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR's data starts after the signature, length and type
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _size(image) -> tuple[int, int]:
    """(width, height) of a decoded image: a PIL image, or a (3, H, W) tensor."""
    return image.size if isinstance(image, Image.Image) else (image.shape[-1], image.shape[-2])


def _refusal(path, w: int, h: int, limit: int = DEFAULT_MAX_IMAGE_PIXELS) -> str:
    return REFUSED.format(path=path, w=w, h=h, pixels=w * h, limit=limit)


def _never_decoded(monkeypatch) -> None:
    """Fail the test if any decoder allocates pixels: the refusal must come from the header alone."""

    def decoding(*args, **kwargs):
        raise AssertionError("a decoder was called on an image over the limit")

    monkeypatch.setattr(jpeg, "decode_jpegs", decoding)
    monkeypatch.setattr(torchvision.io, "decode_image", decoding)
    monkeypatch.setattr(Image.Image, "load", decoding)
    monkeypatch.setattr(Image.Image, "draft", decoding)


LIBRARIES = ["torchcodec", "torchvision", "none"]  # the JPEG library "auto" and "batched" decode with


def _use_library(monkeypatch, library: str) -> None:
    if library == "torchcodec":
        pytest.importorskip("torchcodec")
        assert jpeg.jpeg_library() == "torchcodec"
        return
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setattr(jpeg, "_torchcodec_decoders", lambda: None)
    if library == "none":  # torchvision's deprecated decoders gone too: "auto" decodes JPEGs with PIL
        monkeypatch.delattr(torchvision.io, "decode_jpeg", raising=False)
    assert jpeg.jpeg_library() == (None if library == "none" else "torchvision")


@pytest.mark.parametrize("progressive", [False, True], ids=["SOF0", "SOF2"])
@pytest.mark.parametrize(
    "decoder, library",
    [("auto", lib) for lib in LIBRARIES] + [("torchvision", "torchvision"), ("pil", "none"), ("draft", "none")],
)
def test_every_decoder_refuses_a_jpeg_declaring_20000x20000_from_its_header(
    tmp_path, monkeypatch, decoder, library, progressive
):
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(declaring_jpeg(BOMB_SIDE, BOMB_SIDE, progressive))
    assert bomb.stat().st_size < 4000
    _use_library(monkeypatch, library)
    _never_decoded(monkeypatch)
    started = time.perf_counter()
    with pytest.raises(ImageTooLargeError) as refused:
        load_image(str(bomb), decoder)
    assert time.perf_counter() - started < 0.5
    assert str(refused.value) == _refusal(bomb, BOMB_SIDE, BOMB_SIDE)
    assert isinstance(refused.value, BadImageError)  # DATA.BAD_IMAGE skip skips it like any bad image


@pytest.mark.parametrize("decoder", ["auto", "torchvision", "pil"])
def test_a_png_declaring_20000x20000_is_refused_with_the_same_line(tmp_path, monkeypatch, decoder):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(declaring_png(BOMB_SIDE, BOMB_SIDE))
    _never_decoded(monkeypatch)
    with pytest.raises(ImageTooLargeError, match=f"^{re.escape(_refusal(bomb, BOMB_SIDE, BOMB_SIDE))}$"):
        load_image(str(bomb), decoder)


@pytest.mark.parametrize("decoder", ["auto", "torchvision", "pil", "draft"])
def test_the_limit_is_exact_and_0_means_none(tmp_path, decoder):
    # PIL itself only warns above its Image.MAX_IMAGE_PIXELS and refuses at twice it: ours refuses
    # the first pixel over, and lets through what it allows, however far above PIL's own limit.
    fits, over = tmp_path / "fits.jpg", tmp_path / "over.jpg"
    _noise(40, 30).save(fits, quality=90)
    _noise(40, 31).save(over, quality=90)
    assert _size(load_image(str(fits), decoder, max_pixels=1200)) == (40, 30)
    with pytest.raises(
        ImageTooLargeError, match=r"over\.jpg declares 40x31 pixels \(1240 > DATA.MAX_IMAGE_PIXELS 1200\)"
    ):
        load_image(str(over), decoder, max_pixels=1200)
    load_image(str(over), decoder, max_pixels=0)  # no limit
    huge = declaring_jpeg(13400, 13400)  # 179,560,000 pixels: over twice PIL's default limit
    assert open_image(huge, "huge.jpg", max_pixels=200_000_000).size == (13400, 13400)  # opened, not decoded
    assert open_image(huge, "huge.jpg", max_pixels=0).size == (13400, 13400)


def test_the_default_limit_is_pils_and_the_key_takes_no_negative_value():
    assert get_cfg_defaults().DATA.MAX_IMAGE_PIXELS == DEFAULT_MAX_IMAGE_PIXELS == 1024**3 // 4 // 3 == 89_478_485
    with pytest.raises(ConfigError, match=r"DATA.MAX_IMAGE_PIXELS must be >= 0 \(0: no limit\), got -1"):
        load_cfg(None, ["DATA.MAX_IMAGE_PIXELS", "-1"])


def test_a_file_that_is_no_image_is_named_not_as_a_bytes_buffer(tmp_path):
    notes = tmp_path / "notes.jpg"
    notes.write_text("not an image at all\n")
    for decoder in ("auto", "pil", "draft", "torchvision"):
        with pytest.raises(BadImageError) as refused:
            load_image(str(notes), decoder)
        message = str(refused.value)
        assert message.startswith(f"unreadable image {notes}: ") and "BytesIO" not in message, message
        assert "not an image PIL can identify" in message


@pytest.fixture(scope="module")
def bomb_tree(tmp_path_factory) -> tuple[Path, Path]:
    """8 train and 2 val digits a class (PNG, every other one re-saved as JPEG), and in train/3 a
    JPEG declaring 20000x20000 pixels: (root, the bomb)."""
    root = tmp_path_factory.mktemp("bomb")
    for split, n in (("train", 8), ("val", 2)):
        for c in range(10):
            dest = root / split / str(c)
            dest.mkdir(parents=True)
            for i, png in enumerate(sorted((DIGITS / split / str(c)).glob("*.png"))[:n]):
                if i % 2:
                    Image.open(png).convert("RGB").save(dest / f"{png.stem}.jpg", quality=90)
                else:
                    shutil.copy(png, dest)
    bomb = root / "train" / "3" / "bomb.jpg"
    bomb.write_bytes(declaring_jpeg(BOMB_SIDE, BOMB_SIDE))
    return root, bomb


def _batched_cfg(root: Path, augment: str, *extra: str):
    opts = ["TRAIN.DATASET", str(root), "TEST.DATASET", str(root), "DATA.DECODER", "batched"]
    opts += ["DATA.BATCHED_AUGMENT", augment, "TRAIN.BATCH_SIZE", "9", "TRAIN.IM_SIZE", "16", *extra]
    return load_cfg(None, opts)


@pytest.mark.parametrize("augment", ["True", "False"])
def test_batched_refuses_the_bomb_in_its_workers_and_never_hands_it_to_the_device_decoder(
    bomb_tree, monkeypatch, augment
):
    root, bomb = bomb_tree
    decoded_sizes = []
    decode_jpegs = jpeg.decode_jpegs

    def recording(data, device):
        decoded = decode_jpegs(data, device)
        decoded_sizes.extend(tuple(image.shape[1:]) for image in decoded)
        return decoded

    monkeypatch.setattr(jpeg, "decode_jpegs", recording)
    with pytest.raises(ImageTooLargeError, match=f"^{re.escape(_refusal(bomb, BOMB_SIDE, BOMB_SIDE))}$"):
        list(build_train_split(_batched_cfg(root, augment), DistEnv()).loader)
    skipping = build_train_split(_batched_cfg(root, augment, "DATA.BAD_IMAGE", "skip", "TRAIN.WORKERS", "2"), DistEnv())
    batches = list(skipping.loader)
    assert sum(dropped for _, _, dropped in batches) == 1
    assert sum(len(targets) for _, targets, _ in batches) == 9 * (81 // 9) - 1
    assert decoded_sizes and max(h * w for h, w in decoded_sizes) <= 16 * 16


def _train(root: Path, out: Path, *extra: str):
    args = ["OUT_DIR", str(out), "TRAIN.DATASET", str(root), "TEST.DATASET", str(root), "MODEL.ARCH", FAST_ARCH]
    args += ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "9"]
    args += ["OPTIM.WARMUP_EPOCHS", "0", *extra]
    return in_process(TRAIN, *args)


def test_a_run_given_the_bomb_stops_with_one_line_naming_it(bomb_tree, tmp_path):
    root, bomb = bomb_tree
    result = _train(root, tmp_path / "out")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert errors == [f"distribuuuu: error: {_refusal(bomb, BOMB_SIDE, BOMB_SIDE)}"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "DecompressionBomb" not in result.stderr


def test_a_run_with_bad_image_skip_skips_and_counts_the_bomb(bomb_tree, tmp_path):
    root, _ = bomb_tree
    out = tmp_path / "out"
    assert_ok(_train(root, out, "DATA.BAD_IMAGE", "skip", "TRAIN.WORKERS", "2"))
    train = [r for r in read_metrics(out) if r["split"] == "train"]
    assert [(r["skipped_images"], r["samples"]) for r in train] == [(1, 80)]


def test_decode_image_bytes_names_the_sample_it_was_given():
    # Packed shards and Hugging Face rows reach the decoders as bytes and a name: the name is what
    # the refusal says.
    with pytest.raises(ImageTooLargeError, match=r"^image too large: shard-000003 row 17\.jpg declares 20000x20000"):
        decode_image_bytes(declaring_jpeg(BOMB_SIDE, BOMB_SIDE), "shard-000003 row 17.jpg", "auto")
