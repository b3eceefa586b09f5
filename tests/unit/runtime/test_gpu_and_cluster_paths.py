"""What only a GPU or a cluster would show, tested through seams the CPU runs.

Resume hands CPU RNG states to the restore; a mid-epoch checkpoint never holds non-finite
weights; one visible GPU per task; Slurm's step variables. (Skipped steps counted once per
optimizer step whatever the world size, fp16 on the CPU, a rank that never starts: the launches
and runs of tests/integration/test_gpu_and_cluster_paths_runs.py. Two torchrun agents acting as
two nodes: the hsdp run of tests/integration/test_resume_world_size.py.)
"""

from __future__ import annotations

import dataclasses
import threading
import time

import models
import pytest
import torch
import torch.distributed as dist
from cluster_paths_helpers import TINY, _tensors
from helpers import TINY_TRAIN, in_process
from torch import nn

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import load_cfg
from distribuuuu.models import register_model
from distribuuuu.runtime import process_group as D
from distribuuuu.runtime.launcher import DistEnv, LaunchError, detect_env, parse_slurm_nodelist, select_device
from distribuuuu.training import components, rng
from distribuuuu.training import resume as state
from distribuuuu.training import run as run_setup


@register_model("paths_tiny")
def paths_tiny(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


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
