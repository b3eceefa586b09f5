"""Never mix two experiments (one OUT_DIR, one experiment; every start recorded) and classes by name."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import (
    FAST,
    REPO,
    TEST,
    TINY_ARCH,
    TINY_TRAIN,
    TRAIN,
    assert_ok,
    in_process,
    lone_env,
    read_metrics,
    run_torchrun,
)
from PIL import Image
from runs import EMA_EPOCHS, EMA_RUN_OPTS
from yacs.config import CfgNode

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import DataError, map_classes
from distribuuuu.runtime.launcher import DistEnv, find_free_port
from distribuuuu.runtime.process_group import cleanup_distributed
from distribuuuu.training.inputs import build_train_split, build_val_split
from distribuuuu.training.resume import find_checkpoint_to_resume

DIGITS = REPO / "data" / "digits"
PREDICT = str(REPO / "tools" / "predict.py")


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


# ------------------------------------------------------------------------------------------------
# One OUT_DIR, one experiment
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_another_architecture_in_the_same_out_dir_stops_naming_the_keys_and_touches_nothing(ema_run):
    before = _fingerprint(ema_run)
    result = in_process(TRAIN, "OUT_DIR", str(ema_run), *EMA_RUN_OPTS, "MODEL.ARCH", "resnet34")
    assert result.returncode == 2, result.stderr[-2000:]
    [error] = _errors(result)
    assert "holds another experiment" in error and f"MODEL.ARCH: '{TINY_ARCH}' -> 'resnet34'" in error
    assert "own OUT_DIR" in error and "TRAIN.RESUME_ANYWAY True" in error
    assert _fingerprint(ema_run) == before, "the first run's files must be untouched"


def test_a_refused_resume_ends_the_process_group_it_started(ema_run, monkeypatch):
    """The group outliving the run to the interpreter's exit is what aborted a refused rank 0
    ("terminate called without an active exception", 3 of 12 tries under torchrun)."""
    launch = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    cfg = load_cfg(None, ["OUT_DIR", str(ema_run), *EMA_RUN_OPTS, "MODEL.ARCH", "resnet34"])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ConfigError, match="holds another experiment"):
            trainer.train_model(cfg)
        assert not dist.is_initialized(), "the refused run left its process group to the interpreter's exit"
    finally:
        cleanup_distributed()
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_refused_resume_under_torchrun_exits_2_every_time_without_an_abort(ema_run):
    # The cause (a tool that returned with its process group alive, so a gloo thread could abort the
    # exiting interpreter: 3 of 12 tries before the fix) is pinned in one process by the test above;
    # two real jobs check the symptom end to end (a 25% abort shows with p=0.44; the deterministic
    # check is the in-process one).
    for attempt in range(2):
        result = run_torchrun(2, TRAIN, "OUT_DIR", str(ema_run), *EMA_RUN_OPTS, "MODEL.ARCH", "resnet34")
        codes = re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", result.stderr, re.M)
        assert "Aborted" not in result.stderr and "terminate called" not in result.stderr, (
            attempt,
            result.stderr[-3000:],
        )
        # -15: torchrun stops a rank still running once the other exited; its summary names rank 0's 2.
        assert result.returncode == 1 and "2" in codes and set(codes) <= {"2", "-15"}, (attempt, result.stderr[-3000:])
        assert len(_errors(result)) == 1, (attempt, result.stderr[-3000:])


@pytest.mark.parametrize(
    "keys,message",
    [
        (["MODEL.ARCH", "resnet18"], f"holds {TINY_ARCH} weights but MODEL.ARCH is resnet18: set MODEL.ARCH {TINY_ARCH}"),
        (["MODEL.NUM_CLASSES", "12"], f"does not fit MODEL.ARCH {TINY_ARCH}: 0 tensor(s) missing [], 0 unexpected [], "
                                      "2 of another shape"),
    ],
    ids=["another-arch", "another-head"],
)  # fmt: skip
def test_weights_that_do_not_fit_the_model_stop_test_net_in_one_line(ema_run, tmp_path, keys, message):
    weights = str(ema_run / ckpt.CKPT_DIR / ckpt.checkpoint_name(1))
    result = in_process(TEST, "OUT_DIR", str(tmp_path), *EMA_RUN_OPTS, "MODEL.WEIGHTS", weights, *keys)
    assert result.returncode == 2, result.stderr[-2000:]  # bad input, as a bad key is
    [error] = _errors(result)
    assert error.startswith("distribuuuu: error: MODEL.WEIGHTS: ") and weights in error and message in error, error
    assert "Traceback" not in result.stderr and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("given", ["the run's folder", "a missing file"])
def test_weights_that_are_no_checkpoint_stop_test_net_in_one_line_naming_the_key(ema_run, tmp_path, given):
    weights = str(ema_run) if given == "the run's folder" else str(tmp_path / "nothing.pth.tar")
    result = in_process(TEST, "OUT_DIR", str(tmp_path / "eval"), *EMA_RUN_OPTS, "MODEL.WEIGHTS", weights)
    assert result.returncode == 2, result.stderr[-2000:]
    [error] = _errors(result)
    said = {
        "the run's folder": f"{weights} is a run's OUT_DIR, not a checkpoint: give {ema_run / ckpt.BEST_NAME} or one",
        "a missing file": f"checkpoint not found: {weights}",
    }[given]
    assert error.startswith(f"distribuuuu: error: MODEL.WEIGHTS: {said}"), error


@pytest.mark.slow
def test_more_epochs_continue_the_run_log_the_change_and_keep_every_starts_config(ema_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(ema_run, out)
    more = EMA_EPOCHS + 1
    result = in_process(TINY_TRAIN, "OUT_DIR", str(out), *EMA_RUN_OPTS, "OPTIM.MAX_EPOCH", str(more))
    assert_ok(result)
    assert f"changed runtime keys: OPTIM.MAX_EPOCH: {EMA_EPOCHS} -> {more}" in result.stdout
    assert "OUT_DIR:" in result.stdout  # the copy's OUT_DIR differs from the checkpoint's: a runtime key
    assert [r["epoch"] for r in read_metrics(out) if r["split"] == "train"] == list(range(1, more + 1))
    starts = sorted((out / "starts").iterdir())
    assert len(starts) == 2
    epochs = [CfgNode.load_cfg((s / "config.yaml").read_text()).OPTIM.MAX_EPOCH for s in starts]
    assert epochs == [EMA_EPOCHS, more]
    first, second = (json.loads((s / "manifest.json").read_text()) for s in starts)
    assert first["resumed_from"] is None and second["resumed_from"].endswith(ckpt.checkpoint_name(EMA_EPOCHS))
    assert (second["torch"], second["world_size"], second["launcher"]) == (torch.__version__, 1, "none")
    assert second["device"] and second["python"] and second["hosts"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert second["git"]["commit"] == head.stdout.strip()


def test_resume_anyway_continues_another_experiment_and_runtime_keys_never_stop_a_resume(tmp_path):
    state = {"model": {}, "cfg": load_cfg(None, ["OUT_DIR", str(tmp_path)]).dump(), "epoch": 1}
    ckpt.save_checkpoint(state, str(tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)))
    with pytest.raises(ConfigError, match=r"TRAIN.IM_SIZE: 32 -> 24"):
        find_checkpoint_to_resume(load_cfg(None, ["OUT_DIR", str(tmp_path), "TRAIN.IM_SIZE", "24"]))
    anyway = load_cfg(None, ["OUT_DIR", str(tmp_path), "TRAIN.IM_SIZE", "24", "TRAIN.RESUME_ANYWAY", "True"])
    path, changes, _ = find_checkpoint_to_resume(anyway)
    assert path.endswith(ckpt.checkpoint_name(1)) and "TRAIN.IM_SIZE: 32 -> 24" in changes
    path, changes, _ = find_checkpoint_to_resume(load_cfg(None, ["OUT_DIR", str(tmp_path), "TRAIN.WORKERS", "2"]))
    assert changes == ["TRAIN.WORKERS: 0 -> 2"]


# ------------------------------------------------------------------------------------------------
# Classes by name
# ------------------------------------------------------------------------------------------------
def test_classes_map_by_name_whatever_the_folder_order():
    assert map_classes(["b", "c", "a"], ["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}


def test_numeric_folders_that_are_not_class_names_are_indices_not_string_order():
    model = [f"n{i:02d}" for i in range(12)]
    folder = sorted(str(i) for i in range(12))  # ImageFolder's order: 0, 1, 10, 11, 2, ...
    assert map_classes(folder, model) == {i: int(name) for i, name in enumerate(folder)}


def test_unknown_or_missing_classes_are_one_error_unless_the_overlap_is_asked_for():
    with pytest.raises(
        DataError, match=r"not among the model's \['x'\], no folder for \['c'\]; set TEST.CLASS_OVERLAP"
    ):
        map_classes(["a", "b", "x"], ["a", "b", "c"], where="val")
    assert map_classes(["a", "b", "x"], ["a", "b", "c"], overlap=True) == {0: 0, 1: 1}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_val_folder_with_one_class_more_than_the_model_is_matched_by_name_not_counted(tmp_path, overlap):
    """3 classes trained, 4 val folders: the unknown one is named (or left out under
    TEST.CLASS_OVERLAP), not blamed on MODEL.NUM_CLASSES."""
    for name, digit in {"cat": "0", "dog house": "1", "zebra": "2", "lion": "3"}.items():
        shutil.copytree(DIGITS / "val" / digit, tmp_path / "val" / name)
    opts = ["MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "2", "TEST.DATASET", str(tmp_path), "TRAIN.WORKERS", "0"]
    cfg = load_cfg(None, [*opts, "TEST.CLASS_OVERLAP", str(overlap)])
    model_classes = ["cat", "dog house", "zebra"]
    if not overlap:
        with pytest.raises(DataError, match=r"not among the model's \['lion'\], no folder for \[\]"):
            build_val_split(cfg, DistEnv(), model_classes)
        return
    split = build_val_split(cfg, DistEnv(), model_classes)
    known = sum(len(list((DIGITS / "val" / d).glob("*.png"))) for d in "012")
    assert sum(len(targets) for _, targets, _ in split.loader) == known


def test_a_head_larger_than_the_training_classes_is_one_warning_with_the_count_to_set(tmp_path, caplog):
    for name, digit in {"cat": "0", "dog house": "1", "zebra": "2"}.items():
        shutil.copytree(DIGITS / "train" / digit, tmp_path / "train" / name)
    opts = ["TRAIN.DATASET", str(tmp_path), "TRAIN.WORKERS", "0", "TRAIN.BATCH_SIZE", "8"]
    cfg = load_cfg(None, [*opts, "MODEL.NUM_CLASSES", "10"])  # set on purpose: 0, the default, takes the data's 3
    with caplog.at_level("WARNING", logger="distribuuuu"):
        build_train_split(cfg, DistEnv())
    [said] = [r.getMessage() for r in caplog.records if "MODEL.NUM_CLASSES" in r.getMessage()]
    assert f"MODEL.NUM_CLASSES is 10 but {tmp_path}/train has 3 classes: 7 outputs never train" in said
    assert "set MODEL.NUM_CLASSES 3" in said


def _twelve_class_tree(root: Path, names: list[str]) -> Path:
    """data/digits as 12 classes: the ten digits and inverted copies of 0 and 1, under ``names``."""
    for split in ("train", "val"):
        for label, name in enumerate(names):
            digit, inverted = label % 10, label >= 10
            target = root / split / name
            target.mkdir(parents=True)
            for png in sorted((DIGITS / split / str(digit)).glob("*.png")):
                if inverted:
                    Image.fromarray(255 - np.asarray(Image.open(png).convert("RGB"))).save(target / png.name)
                else:
                    shutil.copy(png, target / png.name)
    return root


@pytest.mark.slow
def test_numeric_val_folders_evaluate_like_the_training_names_and_predict_names_the_classes(tmp_path):
    names = [f"c{i:02d}" for i in range(12)]
    named = _twelve_class_tree(tmp_path / "named", names)
    numbered = tmp_path / "numbered"
    (numbered / "val").mkdir(parents=True)
    for i, name in enumerate(names):  # ImageNet-V2's layout: folder i holds the model's class i
        shutil.copytree(named / "val" / name, numbered / "val" / str(i))
    # FAST's light model: 64.5% after its 2 epochs here (resnet18: 93%, in 3x the time); the floor
    # asks for a model far from the 8% of chance, whose scrambled labels would show.
    data = ["TRAIN.DATASET", str(named), "TEST.DATASET", str(named), "MODEL.NUM_CLASSES", "12"]
    out = tmp_path / "out"
    assert_ok(in_process(TRAIN, "OUT_DIR", str(out), *FAST, *data, env=lone_env()))  # alone: both cores
    weights = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(2))

    def evaluate(root: Path, *extra: str) -> dict:
        ev_out = tmp_path / f"eval_{root.name}"
        args = ["OUT_DIR", str(ev_out), *FAST, *data, "TEST.DATASET", str(root)]
        assert_ok(in_process(TEST, *args, "MODEL.WEIGHTS", weights, *extra, env=lone_env()))
        [record] = [r for r in read_metrics(ev_out) if r["split"] == "test"]
        return record

    by_name, by_number = evaluate(named), evaluate(numbered)
    assert by_name["top1"] > 30, "trained well above the 8% of chance, so scrambled labels would show"
    assert [by_number[k] for k in ("top1", "topk", "samples")] == [by_name[k] for k in ("top1", "topk", "samples")]
    images = sorted((named / "val" / "c10").glob("*.png"))[:3]
    result = in_process(PREDICT, "--weights", weights, *map(str, images))
    assert_ok(result)
    predicted = [line.split(": ", 1)[1].split(" ")[0] for line in result.stdout.splitlines() if ": " in line]
    assert len(predicted) == 3 and set(predicted) <= set(names), result.stdout


@pytest.mark.slow
def test_a_val_folder_with_a_class_the_model_does_not_know_stops_or_evaluates_the_overlap(ema_run, tmp_path):
    val = tmp_path / "odd" / "val"
    for name in ["0", "1", "2"]:
        shutil.copytree(DIGITS / "val" / name, val / name)
    shutil.copytree(DIGITS / "val" / "3", val / "x")
    weights = str(ema_run / ckpt.CKPT_DIR / ckpt.checkpoint_name(1))
    args = [
        "OUT_DIR",
        str(tmp_path / "eval"),
        *EMA_RUN_OPTS,
        "TEST.DATASET",
        str(tmp_path / "odd"),
        "MODEL.WEIGHTS",
        weights,
    ]
    refused = in_process(TEST, *args)
    assert refused.returncode == 2
    [error] = _errors(refused)
    assert "not among the model's ['x']" in error and "TEST.CLASS_OVERLAP" in error
    assert_ok(in_process(TEST, *args, "TEST.CLASS_OVERLAP", "True"))
    [record] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    assert record["samples"] == sum(len(list((val / n).glob("*.png"))) for n in ["0", "1", "2"])
