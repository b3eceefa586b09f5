"""What only a GPU or a cluster would show, tested through seams the CPU runs.

Resume hands CPU RNG states to the restore; skipped steps are counted once per optimizer step
whatever the world size; fp16 runs (and skips overflowing steps) on the CPU; a mid-epoch
checkpoint never holds non-finite weights; one visible GPU per task; a rank that never starts
fails the job quickly; Slurm's step variables. (Two torchrun agents acting as two nodes: the
hsdp run of tests/integration/test_resume_world_size.py.)
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import models
import pytest
import torch
import torch.distributed as dist
from helpers import (
    FAST,
    REPO,
    TINY_TRAIN,
    TRAIN,
    assert_ok,
    clean_env,
    in_process,
    python,
    read_metrics,
    run,
    run_torchrun,
)
from torch import nn

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import load_cfg
from distribuuuu.models import register_model
from distribuuuu.runtime import process_group as D
from distribuuuu.runtime.launcher import (
    DistEnv,
    LaunchError,
    detect_env,
    find_free_port,
    parse_slurm_nodelist,
    select_device,
)
from distribuuuu.training import components, rng
from distribuuuu.training import resume as state
from distribuuuu.training import run as run_setup

DIGITS = str(REPO / "data" / "digits")
TINY = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.DATASET", DIGITS,
    "TEST.DATASET", DIGITS, "OPTIM.MAX_EPOCH", "1",
]  # fmt: skip


@register_model("paths_tiny")
def paths_tiny(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


def _train_records(out_dir) -> list[dict]:
    return [r for r in read_metrics(out_dir) if r["split"] == "train"]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


# ------------------------------------------------------------------------------------------------
# Finding 1: resume on a GPU handed CUDA tensors to torch.set_rng_state
# ------------------------------------------------------------------------------------------------
def test_resume_hands_the_rng_restore_cpu_states_whatever_the_runs_device(tmp_path, monkeypatch, plain_logging):
    cfg = load_cfg(None, ["MODEL.ARCH", "paths_tiny", "OUT_DIR", str(tmp_path), *TINY[2:]])
    saved = run_setup.build_run(cfg, DistEnv())
    saved.state.step_in_epoch = 3
    state.save_training_checkpoint(saved, state.checkpointer(saved.cfg))
    handed: list[dict] = []
    monkeypatch.setattr(components, "restore_rng_state", handed.append)
    # A GPU run names its device "cuda"; "meta" stands in for any device that is not the CPU.
    on_another_device = dataclasses.replace(saved, env=DistEnv(device=torch.device("meta")))
    state.resume_or_load_weights(
        on_another_device, state.checkpointer(on_another_device.cfg), state.find_checkpoint_to_resume(saved.cfg)[0]
    )
    assert len(handed) == 1 and {t.device.type for t in _tensors(handed[0])} == {"cpu"}
    rng.restore_rng_state(handed[0])  # and the real restore takes them


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
# Finding 4: a mid-epoch checkpoint written before the non-finite check saw its steps
# ------------------------------------------------------------------------------------------------
def test_a_mid_epoch_checkpoint_never_holds_weights_from_a_non_finite_step(tmp_path, monkeypatch):
    # NaN at step 3; metrics every 10 steps, a checkpoint every 5: the checkpoint step must check.
    # In this process: FAULT_NAN_CALLS="3", as tests/models.py would have read it at its import.
    monkeypatch.setattr(models, "_NAN_CALLS", {3})
    args = [*TINY, "TRAIN.PRINT_FREQ", "10", "TRAIN.CKPT_PERIOD_ITERS", "5"]
    result = in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path), *args)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and "non-finite loss at epoch 1, step 3:" in errors[0]
    assert ckpt.list_checkpoints(str(tmp_path / "checkpoints")) == []


# ------------------------------------------------------------------------------------------------
# Finding 5: one visible GPU per task
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "local_rank, visible, expected",
    [(0, 0, "cpu"), (5, 0, "cpu"), (0, 1, "cuda:0"), (5, 1, "cuda:0"), (7, 1, "cuda:0"), (3, 8, "cuda:3")],
)
def test_the_device_follows_local_rank_unless_the_task_sees_one_gpu(local_rank, visible, expected):
    assert select_device(local_rank, visible) == torch.device(expected)


def test_more_local_ranks_than_visible_gpus_is_a_launch_error():
    with pytest.raises(LaunchError, match="LOCAL_RANK 4 but only 2 GPUs visible"):
        select_device(4, 2)


def test_a_slurm_task_bound_to_one_gpu_gets_it_whatever_its_localid(monkeypatch):
    """``srun --gpus-per-task=1``: SLURM_LOCALID 5, and CUDA_VISIBLE_DEVICES shows one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    bound: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)  # stop before the process group
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "5", "SLURM_NODELIST": "gpu01"}
    env = D.setup_distributed(environ=slurm)
    assert env.rank == 5 and env.local_rank == 5 and env.device == torch.device("cuda", 0)
    assert bound == [torch.device("cuda", 0)]


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


def test_check_in_names_the_ranks_that_never_joined():
    store = dist.HashStore()
    tic = time.monotonic()
    assert D._check_in(store, DistEnv(rank=1, world_size=3), timeout_s=0.5) == [0, 2]
    assert time.monotonic() - tic < 5


def test_check_in_returns_when_every_rank_has_joined():
    store, results = dist.HashStore(), {}

    def join(rank: int) -> None:
        results[rank] = D._check_in(store, DistEnv(rank=rank, world_size=3), timeout_s=30)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: [], 1: [], 2: []}


# ------------------------------------------------------------------------------------------------
# Slurm: node lists and the step's variables
# ------------------------------------------------------------------------------------------------
def test_several_ranges_and_prefixes_in_a_node_list():
    assert parse_slurm_nodelist("gpu[01-02,05],cpu03") == ["gpu01", "gpu02", "gpu05", "cpu03"]
    assert parse_slurm_nodelist("a[1-2],b-[7,9]x") == ["a1", "a2", "b-7x", "b-9x"]


def test_the_steps_variables_win_over_the_jobs_when_they_disagree():
    """``srun -n 4`` inside an allocation of 8 tasks on a[1-2]: the step runs 4 ranks on b[3-4]."""
    environ = {
        "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NODELIST": "a[1-2]", "SLURM_STEP_NODELIST": "b[3-4]", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "77",
    }  # fmt: skip
    env = detect_env(environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 4, 1, 2)
    assert env.master_addr == "b3" and env.launcher == "slurm"
