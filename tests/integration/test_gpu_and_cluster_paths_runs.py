"""The launches and real training runs of tests/unit/runtime/test_gpu_and_cluster_paths.py: skipped steps
counted once per optimizer step on two ranks (fsdp, fp16 ddp), fp16 on the CPU trained and resumed bit for
bit, and a rank that never starts failing the job quickly."""

from __future__ import annotations

import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_paths_helpers import TINY, _tensors
from helpers import FAST, TINY_TRAIN, TRAIN, assert_ok, clean_env, in_process, python, read_metrics, run, run_torchrun

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.runtime.launcher import find_free_port


def _train_records(out_dir) -> list[dict]:
    return [r for r in read_metrics(out_dir) if r["split"] == "train"]


# ------------------------------------------------------------------------------------------------
# Findings 2 and 3: skipped steps counted once per optimizer step; fp16 on the CPU
# ------------------------------------------------------------------------------------------------
# 2 ranks x 2 micro-batches of 16: forward calls 5 and 6 are optimizer step 3, call 13 starts step 7.
TWO_ACCUM = [*TINY, "TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", "2", "TRAIN.PRINT_FREQ", "5"]
FAULTS = dict(FAULT_NAN_CALLS="5,6", FAULT_INF_GRAD_CALLS="13")


@pytest.mark.slow
def test_two_fsdp_ranks_count_each_skipped_non_finite_step_once(tmp_path):
    """A NaN loss on both ranks' micro-batches of one step, and a step whose loss is finite but
    whose gradients are not: two skipped optimizer steps (not 4 + 0, as per rank and micro-batch).
    Under fsdp the norm that decides is the sharded gradients' global one; under ddp the same
    faults are the fp16 test's below (every rank's all-reduced gradients are non-finite alike),
    and one process counts them in tests/integration/test_non_finite_losses.py."""
    opts = [*TWO_ACCUM, "TRAIN.NAN_POLICY", "skip", "DIST.STRATEGY", "fsdp"]
    # A launch: the count across two ranks' real FSDP gradient sync is the property.
    assert_ok(run_torchrun(2, TINY_TRAIN, "OUT_DIR", str(tmp_path), *opts, timeout=300, env=clean_env(**FAULTS)))
    [record] = _train_records(tmp_path)
    assert record["nonfinite_steps"] == 2 and record["scaler_skips"] == 0
    final = ckpt.load_checkpoint(str(tmp_path / "checkpoints" / ckpt.checkpoint_name(1).replace(".pth.tar", ".dcp")))
    assert all(torch.isfinite(t).all() for t in final["model"].values())


@pytest.mark.slow
def test_fp16_on_the_cpu_counts_each_overflow_skip_once_in_two_processes(tmp_path):
    """Every skipped step halves the scale and nothing grows it in this run, so the number of
    skipped steps is log2(initial scale / final scale): the checkpoint's scaler says it too."""
    init_scale = 2.0**24  # fp16 gradients overflow at first: the scaler backs off step by step
    env = clean_env(**FAULTS, FAULT_FP16_INIT_SCALE=str(init_scale))
    # A launch: two ranks' GradScalers must agree on each skip (DDP's all-reduce of inf gradients).
    opts = [*TWO_ACCUM, "TRAIN.PRECISION", "fp16", "TRAIN.NAN_POLICY", "skip"]
    result = run_torchrun(2, TINY_TRAIN, "OUT_DIR", str(tmp_path), *opts, timeout=600, env=env)
    assert_ok(result)
    assert "fp16 on the CPU is slow" in result.stdout + result.stderr
    [record] = _train_records(tmp_path)
    final = ckpt.load_checkpoint(str(tmp_path / "checkpoints" / ckpt.checkpoint_name(1)))
    halvings = math.log2(init_scale / final["scaler"]["scale"])
    assert halvings >= 3 and record["scaler_skips"] == halvings and record["nonfinite_steps"] == 0
    assert all(t.dtype == torch.float32 for t in final["model"].values() if t.is_floating_point())
    assert all(torch.isfinite(t).all() for t in final["model"].values())


@pytest.mark.slow
def test_fp16_on_the_cpu_trains_and_resumes_its_scaler_bit_identically(tmp_path, monkeypatch):
    args = [*TINY, "OPTIM.MAX_EPOCH", "2", "TRAIN.PRECISION", "fp16", "TRAIN.PRINT_FREQ", "20"]
    env = clean_env(FAULT_FP16_INIT_SCALE=str(2.0**20))
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out, first in ((straight, []), (split, ["TRAIN.STOP_AFTER_EPOCHS", "1"])):
        assert_ok(_tiny_train_here(monkeypatch, "OUT_DIR", str(out), *args, *first, env=env))
    resumed = _tiny_train_here(monkeypatch, "OUT_DIR", str(split), *args, env=env)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout
    train = _train_records(straight)
    assert len(train) == 2 and train[1]["loss"] < train[0]["loss"]
    a, b = (ckpt.load_checkpoint(str(d / "checkpoints" / ckpt.checkpoint_name(2))) for d in (straight, split))
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] < 2.0**20
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a["optimizer"]), _tensors(b["optimizer"])))


def _tiny_train_here(monkeypatch, *args: str, env: dict):
    """tests/scripts/tiny_train.py in this process (in_process); the trainer functions its fault
    hooks wrap (FAULT_FP16_INIT_SCALE: build_run) are put back after the run."""
    with monkeypatch.context() as patched:
        for name in ("build_run", "train_step", "resume_or_load_weights"):
            patched.setattr(trainer, name, getattr(trainer, name))
        return in_process(TINY_TRAIN, *args, env=env)


# ------------------------------------------------------------------------------------------------
# Finding 6: a rank that never starts fails the job within DIST.INIT_CHECK_TIMEOUT_S
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # launches for 10-20 s: out of the quick tier
def test_a_rank_alone_fails_fast_naming_the_rendezvous_and_the_key(tmp_path):
    """Rank 0 alone and rank 1 alone, each of a 2-rank job on its own port, both at once."""
    messages = {0: "rank 0: not every rank reached rendezvous", 1: "rank 1: could not reach rank 0's rendezvous"}

    def alone(rank: int) -> tuple[int, subprocess.CompletedProcess, float]:
        port = find_free_port()
        env = clean_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        args = ["OUT_DIR", str(tmp_path / str(rank)), *FAST, "DIST.INIT_CHECK_TIMEOUT_S", "3", "DIST.TIMEOUT_S", "600"]
        tic = time.monotonic()
        # A launch: the property is a bounded wait; a regression that waits DIST.TIMEOUT_S (or
        # forever) is killed after 90 s here, not left to stall the suite's process.
        return port, run(python(TRAIN, *args), timeout=90, env=env), time.monotonic() - tic

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(messages, pool.map(alone, messages)))
    for rank, (port, result, elapsed) in results.items():
        assert result.returncode == 2, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]
        assert len(errors) == 1 and messages[rank] in errors[0] and "DIST.INIT_CHECK_TIMEOUT_S" in errors[0], errors
        assert f"127.0.0.1:{port}" in errors[0]
        assert elapsed < 60, f"rank {rank} took {elapsed:.0f}s: waited for DIST.TIMEOUT_S, not the start-up check"
