"""Fine-tuning end to end: the digits checkpoint on a subset of its classes, and the evaluation
output of a 2-process training run (extra val set, confusion matrix, predictions), each checked
against what one process computes independently."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import FAST_ARCH, REPO, assert_ok, in_process, lone_env, read_metrics, run_torchrun

from distribuuuu.checkpointing.checkpoint import load_checkpoint, model_state_from

DIGITS = REPO / "data" / "digits"
QUIET = ["TRAIN.PRINT_FREQ", "100", "LOG.PLOT", "False"]
SMALL = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", *QUIET]


def _five_class_copy(root: Path) -> Path:
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        for c in range(5):
            os.symlink(DIGITS / split / str(c), root / split / str(c))
    return root


@pytest.mark.slow
def test_fine_tuning_the_digits_checkpoint_on_5_classes_with_a_new_head_and_a_frozen_stem(digits_run, tmp_path):
    # From the session's 10-class digits run (the recipe; its best.pth.tar) to a 5-class subset in
    # one plain process: the head's shape differs, so it starts new. Measured: 99.4% after 2 epochs
    # (tests/integration/test_tool_matrix.py fine-tunes from every checkpoint form, .dcp folders included).
    pretrained, _, _ = digits_run
    five, fine = _five_class_copy(tmp_path / "digits5"), tmp_path / "fine"
    result = in_process(
        str(REPO / "tools" / "train_net.py"), "OUT_DIR", str(fine), "TRAIN.DATASET", str(five),
        "TEST.DATASET", str(five), "MODEL.NUM_CLASSES", "5", "TRAIN.TOPK", "3",
        "MODEL.WEIGHTS", str(pretrained / "best.pth.tar"), "MODEL.FREEZE", "['conv1.*', 'bn1.*']",
        "OPTIM.BASE_LR", "0.02", "OPTIM.HEAD_LR_MULT", "5.0", "OPTIM.MAX_EPOCH", "2", *QUIET,
        env=lone_env(),  # both cores
    )  # fmt: skip
    assert_ok(result)
    assert "skipped 2 tensors of another shape" in result.stderr + result.stdout  # fc.weight, fc.bias: a new head
    val = [r for r in read_metrics(fine) if r["split"] == "val"]
    assert val[-1]["top1"] >= 95.0 and val[-1]["samples"] == len(torchvision.datasets.ImageFolder(five / "val"))
    before = model_state_from(load_checkpoint(pretrained / "best.pth.tar"))
    after = model_state_from(load_checkpoint(fine / "checkpoints" / "ckpt_ep_002.pth.tar"))
    for name in ("conv1.weight", "bn1.weight", "bn1.bias"):  # frozen: the pretrained tensors, bit for bit
        assert torch.equal(after[name], before[name]), name
    assert not torch.equal(after["layer1.0.conv1.weight"], before["layer1.0.conv1.weight"])  # the rest trained
    assert after["fc.weight"].shape == (5, 512)


@pytest.mark.slow
def test_a_2_process_run_records_its_extra_val_set_and_saves_an_exact_confusion_matrix_and_predictions(tmp_path):
    extra = tmp_path / "digits_again"
    extra.mkdir()
    os.symlink(DIGITS / "val", extra / "val")
    out = tmp_path / "out"
    result = run_torchrun(
        2, str(REPO / "tools" / "train_net.py"), "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "1",
        "TRAIN.SAMPLER", "repeated", "TEST.EXTRA_DATASETS", f"['{extra}']", "TEST.CONFUSION", "True",
        "TEST.SAVE_PREDICTIONS", "True", "MODEL.ARCH", FAST_ARCH, *SMALL, timeout=600,
    )  # fmt: skip
    assert_ok(result)
    records = {r["split"]: r for r in read_metrics(out) if r["split"] != "train"}
    assert set(records) == {"val", "val_digits_again"}
    val_images = torchvision.datasets.ImageFolder(DIGITS / "val")
    for split, record in records.items():
        assert record["samples"] == len(val_images)
        with open(out / "evaluation" / f"{split}_predictions.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        # Every image once, in dataset order, with its own path and class: exact over the 2 ranks.
        assert [int(r["index"]) for r in rows] == list(range(len(val_images)))
        assert [Path(r["path"]).parts[-3:] for r in rows] == [Path(p).parts[-3:] for p, _ in val_images.samples]
        assert [r["target"] for r in rows] == [val_images.classes[t] for _, t in val_images.samples]
        top1_hits = sum(r["top1"] == r["target"] for r in rows)
        assert 100.0 * top1_hits / len(rows) == pytest.approx(record["top1"], abs=1e-9)
        confusion = json.loads((out / "evaluation" / f"{split}_per_class.json").read_text())["confusion"]
        assert sum(map(sum, confusion)) == len(rows)
        assert sum(confusion[c][c] for c in range(10)) == top1_hits
        by_hand = [[0] * 10 for _ in range(10)]
        for r in rows:
            by_hand[int(r["target"])][int(r["top1"])] += 1
        assert confusion == by_hand
    assert records["val"]["top1"] == records["val_digits_again"]["top1"]  # the same images, the same weights
