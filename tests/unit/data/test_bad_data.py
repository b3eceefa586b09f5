"""Bad data: a truncated image stops the run naming its path (or is skipped and counted), non-image
files are ignored, and an empty class folder, mismatched splits or too few classes stop before training."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_ARCH, REPO, TRAIN, assert_ok, in_process, read_metrics, truncated_jpeg
from PIL import Image

from distribuuuu import cli, trainer
from distribuuuu.data import load_image
from distribuuuu.data.errors import DataError, import_extra

DIGITS = REPO / "data" / "digits"
PER_CLASS = {"train": 8, "val": 2}
GOOD_TRAIN = 10 * PER_CLASS["train"]
# Batch 9 with 80 good images + 1 bad: 9 full batches, so drop_last never hides the bad one.
SMALL = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "9"]
SMALL += ["TRAIN.PRINT_FREQ", "3", "OPTIM.WARMUP_EPOCHS", "0", "MODEL.ARCH", FAST_ARCH]


pytestmark = pytest.mark.usefixtures("plain_logging")


def _digits_tree(root: Path) -> Path:
    """A small ImageFolder copy of the digits: 8 train and 2 val PNGs per class, plus a notes.txt."""
    for split, n in PER_CLASS.items():
        for cls in sorted(p.name for p in (DIGITS / split).iterdir()):
            dest = root / split / cls
            dest.mkdir(parents=True)
            for png in sorted((DIGITS / split / cls).glob("*.png"))[:n]:
                shutil.copy(png, dest)
    (root / "train" / "0" / "notes.txt").write_text("not an image: ImageFolder must ignore it\n")
    return root


@pytest.fixture
def bad_tree(tmp_path) -> tuple[Path, Path]:
    """A digits tree whose train/3 holds a truncated JPEG; returns (root, the bad file)."""
    root = _digits_tree(tmp_path / "data")
    return root, truncated_jpeg(root / "train" / "3" / "broken.jpg")


def _train(root: Path, out: Path, *extra: str):
    args = ["OUT_DIR", str(out), "TRAIN.DATASET", str(root), "TEST.DATASET", str(root), *SMALL, *extra]
    return in_process(TRAIN, *args)  # train_net.py's __main__ here: its exit code, its stderr


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("distribuuuu: error:")]


@pytest.mark.parametrize("workers, decoder", [(0, "auto"), (2, "auto"), (2, "batched")])
def test_truncated_image_stops_the_run_naming_its_path(bad_tree, tmp_path, workers, decoder):
    root, bad = bad_tree
    result = _train(root, tmp_path / "out", "TRAIN.WORKERS", str(workers), "DATA.DECODER", decoder)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and f"unreadable image {bad}" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "checkpoints" / "ckpt_ep_001.pth.tar").exists(), "the epoch did not finish"


def test_bad_image_skip_drops_and_counts_it_and_ignores_non_images(bad_tree, tmp_path):
    root, _ = bad_tree
    out = tmp_path / "out"
    result = _train(root, out, "DATA.BAD_IMAGE", "skip")
    assert_ok(result)
    warned = [line for line in (result.stdout + result.stderr).splitlines() if "unreadable image" in line]
    assert len(warned) == 1 and "training, epoch 1: skipped 1 unreadable image(s)" in warned[0], warned
    train = [r for r in read_metrics(out) if r["split"] == "train"]
    # The epoch visits every file once: the bad JPEG is skipped once, notes.txt never loaded.
    assert [(r["skipped_images"], r["samples"]) for r in train] == [(1, GOOD_TRAIN)]
    val = [r for r in read_metrics(out) if r["split"] == "val"]
    assert val[-1]["samples"] == 10 * PER_CLASS["val"] and val[-1]["skipped_images"] == 0


def _before_training(root: Path, out: Path, capsys, *extra: str) -> str:
    """Run train_model in this process; assert it stops with exit 2 before training; return the line."""
    args = ["OUT_DIR", str(out), "TRAIN.DATASET", str(root), "TEST.DATASET", str(root), *SMALL, *extra]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_BAD_INPUT
    assert not (out / "metrics.jsonl").exists() and not list((out / "checkpoints").glob("*"))
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1
    return errors[0]


def test_empty_class_folder_is_an_error_before_training(tmp_path, capsys):
    root = _digits_tree(tmp_path / "data")
    for png in (root / "train" / "4").glob("*.png"):
        png.unlink()
    (root / "train" / "4" / "README.md").write_text("only a non-image left: the class is empty")
    line = _before_training(root, tmp_path / "out", capsys)
    assert f"{root / 'train'}: class folder(s) with no images" in line and "'4'" in line


def test_train_val_class_mismatch_is_an_error_before_training(tmp_path, capsys):
    root = _digits_tree(tmp_path / "data")
    shutil.rmtree(root / "val" / "9")
    (root / "val" / "x").mkdir()
    shutil.copy(next((DIGITS / "val" / "9").glob("*.png")), root / "val" / "x")
    line = _before_training(root, tmp_path / "out", capsys)
    assert "class folders differ" in line and "not among the model's ['x'], no folder for ['9']" in line


def test_num_classes_smaller_than_class_folders_is_an_error_before_training(tmp_path, capsys):
    root = _digits_tree(tmp_path / "data")
    line = _before_training(root, tmp_path / "out", capsys, "MODEL.NUM_CLASSES", "5")
    assert "MODEL.NUM_CLASSES is 5" in line and "10 class folders" in line


def test_auto_decoder_takes_torchvision_for_jpeg_and_pil_for_png_with_the_same_pixels(tmp_path):
    from torchvision import tv_tensors

    pixels = np.random.default_rng(1).integers(0, 256, (8, 8), dtype=np.uint8)
    png, jpeg = tmp_path / "a.png", tmp_path / "a.jpg"
    Image.fromarray(pixels).save(png)
    Image.fromarray(pixels).save(jpeg, quality=100)
    from_png, from_jpeg = load_image(str(png), "auto"), load_image(str(jpeg), "auto")
    assert isinstance(from_png, Image.Image) and from_png.mode == "RGB"
    assert isinstance(from_jpeg, tv_tensors.Image) and from_jpeg.shape == (3, 8, 8)
    # Grayscale becomes RGB either way, and both decoders read the same JPEG alike.
    via_pil = np.asarray(load_image(str(jpeg), "pil")).transpose(2, 0, 1).astype(int)
    assert np.abs(via_pil - from_jpeg.numpy().astype(int)).max() <= 2


# ------------------------------------------------------------------------------------------------
# Packed data without the "data" extra: one line naming the module and the extra, exit 2
# ------------------------------------------------------------------------------------------------
def test_packing_without_webdataset_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "webdataset", None)  # what an install without the extra imports
    result = in_process(str(REPO / "tools" / "pack_dataset.py"), str(DIGITS), str(tmp_path / "packed"))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"pack_dataset.py: error: packing {DIGITS} needs webdataset: pip install 'distribuuuu[data]'"
    )


def test_training_from_packed_shards_without_wids_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    for split in ("train", "val"):  # what makes a folder a packed dataset: its splits' index.json
        (tmp_path / split).mkdir()
        (tmp_path / split / "index.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "wids", None)
    result = in_process(
        TRAIN, *SMALL, "TRAIN.DATASET", str(tmp_path), "TEST.DATASET", str(tmp_path), "OUT_DIR", str(tmp_path / "out")
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"distribuuuu: error: reading the packed dataset {tmp_path} needs wids: pip install 'distribuuuu[data]'"
    ]
    assert "Traceback" not in result.stderr


def test_an_installed_extra_that_fails_to_import_keeps_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "webdataset", None)  # not installed: the extra's line
    with pytest.raises(DataError, match=r"^packing here needs webdataset: pip install 'distribuuuu\[data\]'$"):
        import_extra("webdataset", "packing here", "data")
    (tmp_path / "broken_extra.py").write_text("import a_dependency_it_lacks\n")  # installed, its dependency not
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_it_lacks"):
        import_extra("broken_extra", "packing here", "data")
