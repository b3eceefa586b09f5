"""Real runs of the training entry point with the recipe's tiny model (tests/scripts/recipe_job.py, the
worker: train_net.py's / test_net.py's entry point with counters), 2-process gloo jobs included:
accumulation against the large batch, the linear scaling rule, EMA on every rank, ZeRO-1 and its resume
in one process, bf16, and a compiled model's checkpoint. The runs of tests/unit/training/test_recipe.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_ok, in_process, python, read_metrics, run, run_torchrun
from recipe_helpers import TINY, RecipeCNN

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint
from distribuuuu.config import load_cfg
from distribuuuu.training import parallelize
from distribuuuu.training.optim import lr_at

# ------------------------------------------------------------------------------------------------
# Real runs of the training entry point (tests/scripts/recipe_job.py as the worker), 2-process gloo jobs included
# ------------------------------------------------------------------------------------------------
WORKER = str(REPO / "tests" / "scripts" / "recipe_job.py")
ONE_EPOCH = [*TINY, "OPTIM.MAX_EPOCH", "1", "OPTIM.EMA_DECAY", "0.9", "OPTIM.EMA_WARMUP", "False"]


def worker_run(out_dir: Path, *opts: str, mode: str = "train", launch: bool = False, timeout: float = 300):
    """Run the worker with one rank, in this process unless ``launch`` (a process of its own);
    return (result, its stats)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = (mode, "OUT_DIR", str(out_dir), *opts)
    if launch:
        result = run(python(WORKER, *args), timeout=timeout)
    else:
        counted = parallelize.wrap_model, trainer.optimizer_step  # the worker's counters wrap them: put back after
        try:
            result = in_process(WORKER, *args)
        finally:
            parallelize.wrap_model, trainer.optimizer_step = counted
    assert_ok(result)
    return result, json.loads((out_dir / f"stats_{mode}.rank0.json").read_text())


def final_checkpoint(out_dir: Path) -> dict:
    return checkpoint.load_checkpoint(checkpoint.list_checkpoints(str(out_dir / checkpoint.CKPT_DIR))[-1])


def weight_count() -> int:
    return sum(p.numel() for p in RecipeCNN(10).parameters())


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict:
    """One epoch of the tiny model on 2 gloo ranks: batch 32, the same as 16 x 2 accumulated, and ZeRO-1.

    Each run's global batch is 64 and OPTIM.REFERENCE_BATCH 128 halves OPTIM.BASE_LR.
    """
    root = tmp_path_factory.mktemp("two_process")
    common = [*ONE_EPOCH, "OPTIM.REFERENCE_BATCH", "128", "OPTIM.BASE_LR", "0.2"]
    variants = {
        "plain": ["TRAIN.BATCH_SIZE", "32"],
        "accum": ["TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", "2"],
        "zero": ["TRAIN.BATCH_SIZE", "32", "OPTIM.ZERO", "True"],
    }

    args = [arg for name, opts in variants.items() for arg in ("--then", "OUT_DIR", str(root / name), *common, *opts)]
    assert_ok(run_torchrun(2, WORKER, "train", *args[1:], timeout=400))  # the three runs, one after another
    return {
        name: {
            "dir": root / name,
            "log": (root / name / "log.txt").read_text(),
            "stats": [json.loads((root / name / f"stats_train.rank{r}.json").read_text()) for r in (0, 1)],
        }
        for name in variants
    }


@pytest.mark.slow
def test_accumulation_matches_the_large_batch_and_all_reduces_once_per_optimizer_step(two_process_runs):
    plain, accum = two_process_runs["plain"], two_process_runs["accum"]
    steps = 1436 // 2 // 32  # optimizer steps of the epoch, for both
    for r in (0, 1):
        assert plain["stats"][r]["steps"] == accum["stats"][r]["steps"] == steps
        buckets = plain["stats"][r]["allreduces"] // steps
        assert buckets >= 1 and plain["stats"][r]["allreduces"] == steps * buckets
        # Twice as many micro-batches, the same number of all-reduces: no_sync skips every other one.
        assert accum["stats"][r]["allreduces"] == steps * buckets
    # The run did train: the mean loss of its last PRINT_FREQ window is well below the first's
    # (no accuracy floor: after one epoch of 22 steps it would depend on the CPU).
    windows = _loss_windows(plain["log"])
    assert len(windows) == 3 and windows[-1] < 0.75 * windows[0], windows
    a, b = final_checkpoint(plain["dir"])["model"], final_checkpoint(accum["dir"])["model"]
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k


def _loss_windows(stdout: str) -> list[float]:
    """The mean training loss of each PRINT_FREQ window, from the log lines."""
    return [float(m) for m in re.findall(r"step \d+/\d+  loss ([\d.]+)", stdout)]


@pytest.mark.slow
def test_the_linear_scaling_rule_is_logged_and_drives_the_schedule(two_process_runs):
    plain = two_process_runs["plain"]
    assert "global batch 64 (32 x 2 ranks x 1 accumulation)" in plain["log"]
    assert "base LR 0.1 (OPTIM.BASE_LR x 64/128)" in plain["log"]
    record = next(r for r in read_metrics(plain["dir"]) if r["split"] == "train")
    optim = load_cfg(None, ["OPTIM.MAX_EPOCH", "1"]).OPTIM
    steps = record["step"]
    assert record["lr"] == pytest.approx(lr_at(steps - 1, steps, optim, base_lr=0.2 * 64 / 128), rel=1e-9)


@pytest.mark.slow
def test_ema_is_the_same_on_every_rank_and_evaluated_beside_the_raw_weights(two_process_runs):
    for name, runs in two_process_runs.items():
        ema0, ema1 = (torch.tensor(s["ema"]) for s in runs["stats"])
        assert torch.equal(ema0, ema1), f"{name}: the ranks' EMA weights differ"
        val = [r["weights"] for r in read_metrics(runs["dir"]) if r["split"] == "val"]
        assert val == ["model", "ema"]
        state = final_checkpoint(runs["dir"])
        assert state["best_weights"] in ("model", "ema") and state["ema"]["updates"] == runs["stats"][0]["steps"]


@pytest.mark.slow
def test_zero_shards_the_optimizer_state_and_trains_the_same_weights(two_process_runs):
    plain, zero = two_process_runs["plain"], two_process_runs["zero"]
    total = weight_count()  # SGD momentum: one buffer element per weight
    assert [s["state_elements"][-1] for s in plain["stats"]] == [total, total]
    shards = [s["state_elements"][-1] for s in zero["stats"]]
    assert sum(shards) == total and all(0.4 * total <= n <= 0.6 * total for n in shards), shards
    a, b = final_checkpoint(plain["dir"]), final_checkpoint(zero["dir"])
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6), k
    # The checkpoint holds the consolidated state of both shards, as the unsharded run's.
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    assert len(b["optimizer"]["state"]) == len(a["model"])
    for i, s in a["optimizer"]["state"].items():
        assert torch.allclose(s["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"], atol=1e-6)
    assert [g["weight_decay"] for g in b["optimizer"]["param_groups"]] == [5e-5, 0.0]


@pytest.mark.slow
def test_a_zero_checkpoint_resumes_in_one_process(two_process_runs, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(two_process_runs["zero"]["dir"], out)
    common = [*ONE_EPOCH, "OPTIM.REFERENCE_BATCH", "128", "OPTIM.BASE_LR", "0.2", "TRAIN.BATCH_SIZE", "32"]
    result, stats = worker_run(out, *common, "OPTIM.ZERO", "True", "OPTIM.MAX_EPOCH", "2")
    assert "resumed from" in result.stdout and "ckpt_ep_001.pth.tar at epoch 2" in result.stdout
    assert stats["state_elements_at_start"] == weight_count()  # both shards' momentum, loaded
    state = final_checkpoint(out)
    assert state["epoch"] == 2 and state["world_size"] == 1
    assert [r["epoch"] for r in read_metrics(out) if r["split"] == "train"] == [1, 2]


@pytest.mark.slow
def test_a_bf16_run_trains_with_float32_weights(tmp_path):
    out = tmp_path / "bf16"
    result, stats = worker_run(
        out, *TINY, "TRAIN.PRECISION", "bf16", "TRAIN.CHANNELS_LAST", "True", "OPTIM.MAX_EPOCH", "1"
    )
    assert stats["logits_dtypes"] == ["torch.bfloat16"]  # autocast was on in every training forward
    assert stats["param_dtypes"] == ["torch.float32"]  # and the weights stayed float32 after every step
    # It trained: the mean loss of the last PRINT_FREQ window is well below the first's.
    windows = _loss_windows(result.stdout)
    assert len(windows) == 5 and windows[-1] < 0.75 * windows[0], windows
    assert {v.dtype for v in final_checkpoint(out)["model"].values()} == {torch.float32}


@pytest.mark.slow
def test_a_compiled_models_checkpoint_loads_into_the_plain_model(tmp_path):
    out = tmp_path / "compiled"
    # A process of its own: Inductor's compile workers live as long as the process that compiled.
    worker_run(out, *TINY, "TRAIN.COMPILE", "True", "OPTIM.MAX_EPOCH", "1", launch=True, timeout=400)
    state = final_checkpoint(out)
    assert list(state["model"]) == list(RecipeCNN(10).state_dict())  # no _orig_mod. prefixes
    path = out / checkpoint.CKPT_DIR / "ckpt_ep_001.pth.tar"
    result, _ = worker_run(out, *TINY, "MODEL.WEIGHTS", str(path), mode="test")
    test = [r for r in read_metrics(out) if r["split"] == "test"][-1]
    [val] = [r for r in read_metrics(out) if r["split"] == "val"]
    # Eager and compiled kernels may round differently: allow one of 361 images to flip. The loss,
    # a sum over every image, tells the same weights from others whatever the accuracy reached.
    assert abs(test["top1"] - val["top1"]) <= 100 / 361 + 1e-9
    assert test["loss"] == pytest.approx(val["loss"], rel=1e-3)
