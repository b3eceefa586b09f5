"""A practitioner's first hour: test_net.py evaluates a checkpoint with the config its run stored,
weights that do not fit the config name the key and the config to use, and a run stopped by bad
input after start-up leaves OUT_DIR as it found it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from helpers import EVAL_TINY, REPO, TEST, TINY_TRAIN, assert_ok, in_process, read_metrics

from distribuuuu.checkpointing import checkpoint as ckpt

DIGITS = REPO / "data" / "digits"
# Non-default model and data keys: a test_net.py that built the default config would fail to load
# the 5-class head, or evaluate another dataset at another size.
RUN_OPTS = [*EVAL_TINY, "MODEL.NUM_CLASSES", "5", "TRAIN.TOPK", "3", "OPTIM.MAX_EPOCH", "1", "OPTIM.BASE_LR", "0.4"]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("distribuuuu: error:")]


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (folders included), files by content."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in folder.rglob("*")
    }


@pytest.fixture(scope="module")
def five_class_run(tmp_path_factory) -> tuple[Path, Path]:
    """One epoch of the tiny CNN on digits 0-4 (a 5-class copy): (its dataset, its OUT_DIR)."""
    root = tmp_path_factory.mktemp("five")
    data = root / "digits5"
    for split in ("train", "val"):
        (data / split).mkdir(parents=True)
        for c in range(5):
            os.symlink(DIGITS / split / str(c), data / split / str(c))
    out = root / "out"
    dataset = ["TRAIN.DATASET", str(data), "TEST.DATASET", str(data)]
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *dataset, *RUN_OPTS))
    return data, out


def test_test_net_without_cfg_evaluates_a_5_class_checkpoint_as_its_run_validated(five_class_run, tmp_path):
    data, out = five_class_run
    weights = out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)
    result = in_process(TEST, "MODEL.WEIGHTS", str(weights), "OUT_DIR", str(tmp_path / "eval"))
    assert_ok(result)
    [val] = [r for r in read_metrics(out) if r["split"] == "val" and r["weights"] == "model"]
    [test] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    # The run's own dataset, size and head: the same images, the same numbers as its validation.
    assert test["samples"] == val["samples"] == sum(len(os.listdir(data / "val" / str(c))) for c in range(5))
    assert (test["top1"], test["topk"], test["loss"]) == pytest.approx((val["top1"], val["topk"], val["loss"]))


def test_command_line_keys_win_over_the_checkpoints_config(five_class_run, tmp_path):
    _, out = five_class_run
    weights = out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)
    only = tmp_path / "two"  # the first two classes of the run's val set
    for c in range(2):
        (only / "val").mkdir(parents=True, exist_ok=True)
        os.symlink(DIGITS / "val" / str(c), only / "val" / str(c))
    args = ["MODEL.WEIGHTS", str(weights), "OUT_DIR", str(tmp_path / "eval"), "TEST.DATASET", str(only)]
    assert_ok(in_process(TEST, *args, "TEST.CLASS_OVERLAP", "True"))
    [test] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    assert test["samples"] == sum(len(os.listdir(only / "val" / str(c))) for c in range(2))


@pytest.mark.parametrize("given", ["cfg-file", "command-line"])
def test_weights_that_do_not_fit_name_the_key_and_the_runs_config(five_class_run, tmp_path, given):
    _, out = five_class_run
    weights = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1))
    ten = ["MODEL.NUM_CLASSES", "10"]
    if given == "cfg-file":  # e.g. the config of the 10-class run the model was fine-tuned from
        cfg = tmp_path / "ten.yaml"
        cfg.write_text("MODEL:\n  ARCH: tiny_cnn\n  NUM_CLASSES: 10\n")
        ten = ["--cfg", str(cfg)]
    result = in_process(TEST, *ten, "MODEL.WEIGHTS", weights, "OUT_DIR", str(tmp_path / "eval"))
    assert result.returncode == 2, result.stderr[-2000:]  # bad input: exit 2, as a bad key
    [error] = _errors(result.stderr)
    assert f"{weights} does not fit" in error and "2 of another shape fc.bias: [5] in the file" in error, error
    assert "it was trained with MODEL.NUM_CLASSES 5 (here 10)" in error, error
    assert f"--cfg {out / 'config.yaml'}" in error, error
    assert "Traceback" not in result.stderr and not (tmp_path / "eval").exists()


def test_a_train_run_stopped_by_bad_input_after_start_up_creates_no_out_dir(five_class_run, tmp_path):
    data, _ = five_class_run
    out = tmp_path / "new"
    dataset = ["TRAIN.DATASET", str(data), "TEST.DATASET", str(data)]
    result = in_process(TINY_TRAIN, "OUT_DIR", str(out), *dataset, *RUN_OPTS, "TRAIN.BATCH_SIZE", "1000")
    assert result.returncode == 2, result.stderr[-2000:]
    [error] = _errors(result.stderr)
    assert "TRAIN.BATCH_SIZE" in error
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_resumed_run_stopped_by_bad_input_leaves_the_earlier_run_as_it_was(five_class_run, tmp_path):
    data, earlier = five_class_run
    out = tmp_path / "out"
    shutil.copytree(earlier, out, symlinks=True)
    before = _fingerprint(out)
    dataset = ["TRAIN.DATASET", str(data), "TEST.DATASET", str(data)]
    more = [*RUN_OPTS, "OPTIM.MAX_EPOCH", "2", "TRAIN.BATCH_SIZE", "1000"]  # it resumes, then stops
    result = in_process(TINY_TRAIN, "OUT_DIR", str(out), *dataset, *more)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(_errors(result.stderr)) == 1
    assert _fingerprint(out) == before  # no new start, config.yaml and log.txt as they were


def test_top_k_is_left_out_where_k_is_not_below_the_number_of_classes(five_class_run, tmp_path):
    """Top-5 of a 5-class model is always 100%: neither the record nor the log line carries it."""
    _, out = five_class_run
    weights = out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)
    result = in_process(TEST, "MODEL.WEIGHTS", str(weights), "OUT_DIR", str(tmp_path / "eval"), "TRAIN.TOPK", "5")
    assert_ok(result)
    [test] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    assert "topk" not in test and "k" not in test and test["top1"] >= 0
    assert "test " in result.stdout and "top5" not in result.stdout, result.stdout[-2000:]
    # The run itself (top-3 of 5 classes) reports its k everywhere.
    assert all(r["k"] == 3 for r in read_metrics(out))
    assert "top3 " in (out / "log.txt").read_text()
