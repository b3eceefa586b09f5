"""MODEL.NUM_CLASSES left at its default (0) is the training data's class count: said in the log,
stored in the checkpoint (its config and classes) and in OUT_DIR/config.yaml; a value set on
purpose that disagrees with the data stays the warning or error it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from helpers import EVAL_TINY, REPO, TINY_TRAIN, assert_ok, in_process

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import ConfigError, load_cfg, stored_config
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split
from distribuuuu.training.run import build_run

DIGITS = REPO / "data" / "digits"
PREDICT = str(REPO / "tools" / "predict.py")
NAMES = ["cat", "dog", "zebra"]


def three_classes(root: Path) -> Path:
    """data/digits' 0, 1 and 2 as three named class folders, train and val."""
    for split in ("train", "val"):
        for digit, name in enumerate(NAMES):
            shutil.copytree(DIGITS / split / str(digit), root / split / name)
    return root


def train_on(data: Path, out: Path, *extra: str):
    """The tiny CNN trained on ``data`` into ``out`` (train_net.py's entry point in this process)."""
    opts = ["TRAIN.DATASET", str(data), "TEST.DATASET", str(data), "TRAIN.WORKERS", "0", "LOG.PLOT", "False"]
    return in_process(TINY_TRAIN, "OUT_DIR", str(out), *EVAL_TINY, *opts, *extra)


def test_three_class_folders_with_the_default_train_a_three_way_head_that_predict_reads(tmp_path):
    data, out = three_classes(tmp_path / "data"), tmp_path / "out"
    folders = sorted(p.name for p in (data / "train").iterdir() if p.is_dir())
    result = train_on(data, out, "OPTIM.MAX_EPOCH", "1")
    assert_ok(result)
    said = [line for line in result.stdout.splitlines() if "MODEL.NUM_CLASSES left to the data" in line]
    assert len(said) == 1 and f"{len(folders)} classes, from {data}/train" in said[0], said
    assert "never train" not in result.stdout + result.stderr
    best = ckpt.load_checkpoint(str(out / "best.pth.tar"))
    assert best["model"]["fc.weight"].shape[0] == len(folders) and best["classes"] == folders
    assert stored_config(best["cfg"], "best").MODEL.NUM_CLASSES == len(folders)
    assert yaml.safe_load((out / "config.yaml").read_text())["MODEL"]["NUM_CLASSES"] == len(folders)
    predicted = in_process(PREDICT, "--weights", str(out / "best.pth.tar"), "--topk", "1", str(data / "val" / "dog"))
    assert_ok(predicted)
    assert all(line.split(": ")[1].split()[0] in folders for line in predicted.stdout.strip().splitlines())


def test_a_resume_with_the_default_continues_the_run_whose_count_came_from_the_data(tmp_path):
    data, out = three_classes(tmp_path / "data"), tmp_path / "out"
    assert_ok(train_on(data, out, "OPTIM.MAX_EPOCH", "1"))
    again = train_on(data, out, "OPTIM.MAX_EPOCH", "2")
    assert_ok(again)
    assert "another experiment" not in again.stderr and "resumed from" in again.stdout
    assert ckpt.load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(2)))["epoch"] == 2


def test_a_resume_after_the_data_gained_a_class_is_refused_in_one_line_naming_both_counts(tmp_path):
    data, out = three_classes(tmp_path / "data"), tmp_path / "out"
    assert_ok(train_on(data, out, "OPTIM.MAX_EPOCH", "1"))
    for split in ("train", "val"):
        shutil.copytree(DIGITS / split / "3", data / split / "lion")
    before = (out / "metrics.jsonl").read_bytes()
    again = train_on(data, out, "OPTIM.MAX_EPOCH", "2")
    assert again.returncode == 2, again.stderr
    [line] = again.stderr.strip().splitlines()
    assert "trained on 3 classes, the training data now has 4" in line, line
    assert (out / "metrics.jsonl").read_bytes() == before


def test_the_default_resolves_topk_to_at_most_the_data_class_count(tmp_path):
    """TRAIN.TOPK 5 (its default) over 3 classes: the rule TOPK <= NUM_CLASSES holds of the run's config."""
    data = three_classes(tmp_path / "data")
    cfg = load_cfg(None, [*EVAL_TINY, "TRAIN.DATASET", str(data), "TEST.DATASET", str(data), "TRAIN.WORKERS", "0"])
    run = build_run(cfg, DistEnv())
    assert (run.cfg.MODEL.NUM_CLASSES, run.cfg.TRAIN.TOPK) == (3, 3)
    assert run.task.reported_k(run.cfg.TRAIN.TOPK) is None  # top-3 of 3 classes is always 100%: not reported


def test_a_topk_set_above_the_data_class_count_is_the_rules_error_naming_both(tmp_path):
    data = three_classes(tmp_path / "data")
    cfg = load_cfg(None, [*EVAL_TINY, "TRAIN.DATASET", str(data), "TEST.DATASET", str(data), "TRAIN.TOPK", "4"])
    with pytest.raises(ConfigError, match=r"^TRAIN.TOPK must be in 1..MODEL.NUM_CLASSES, got 4 \(MODEL.NUM_CLASSES 3"):
        build_run(cfg, DistEnv())


def test_a_count_set_on_purpose_that_the_data_exceeds_stays_an_error(tmp_path):
    data = three_classes(tmp_path / "data")
    cfg = load_cfg(None, ["TRAIN.DATASET", str(data), "MODEL.NUM_CLASSES", "2", "TRAIN.TOPK", "1"])
    with pytest.raises(ConfigError, match=rf"MODEL.NUM_CLASSES is 2 but {data}/train has 3 class folders"):
        build_train_split(cfg, DistEnv())


def test_the_original_distribuuuus_configs_that_set_num_classes_keep_it():
    cfg = load_cfg(str(REPO / "config" / "resnet18.yaml"))
    assert cfg.MODEL.NUM_CLASSES == 1000
