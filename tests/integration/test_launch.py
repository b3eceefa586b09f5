"""Real multi-process jobs on the CPU (gloo): srun-style launch, exact evaluation, utils.

Auto-resume after an epoch is tested in test_exact_resume.py, beside the uninterrupted run it must equal.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    DUMMY_OPTS,
    FAST,
    REPO,
    TEST,
    TRAIN,
    Started,
    assert_ok,
    clean_env,
    in_process,
    on_ranks,
    python,
    read_metrics,
    run_torchrun,
)

from distribuuuu import utils
from distribuuuu.checkpointing.checkpoint import load_checkpoint
from distribuuuu.runtime.launcher import find_free_port

ONE_EPOCH = [*FAST, "OPTIM.MAX_EPOCH", "1"]  # later keys win: FAST's 2 epochs become 1
# Counted on disk, not copied from a run: 361, divisible by neither 2 nor 3.
VAL_IMAGES = sum(1 for p in (REPO / "data" / "digits" / "val").rglob("*") if p.is_file())
TEARDOWN_JOB = str(REPO / "tests" / "scripts" / "teardown_job.py")


def _split(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r["split"] == split]


def _run_together(cmd: list[str], envs: list[dict], timeout: float) -> list:
    """One process per env, started together: their finished processes (all killed on a timeout)."""
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(Started(cmd, env)) for env in envs]
        deadline = time.monotonic() + timeout
        return [s.result(max(1.0, deadline - time.monotonic())) for s in started]


# ------------------------------------------------------------------------------------------------
# srun-style launch: SLURM_* variables only, no torchrun; exact evaluation of what it saved
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory) -> Path:
    """OUT_DIR of one epoch trained by two tasks that see only SLURM_* variables (as under srun)."""
    tmp_path = tmp_path_factory.mktemp("slurm")
    out_dir = tmp_path / "out"
    port, job_id = str(find_free_port()), "4242"
    envs = [
        clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_ID=job_id,
            SLURM_TASKS_PER_NODE="2",
            MASTER_PORT=port,
        )
        for rank in (0, 1)
    ]
    for result in _run_together(python(TRAIN, "OUT_DIR", str(out_dir), *ONE_EPOCH), envs, timeout=400):
        assert_ok(result)
    return out_dir


@pytest.mark.slow
def test_two_tasks_with_only_slurm_variables_train_and_checkpoint(slurm_run):
    out_dir = slurm_run
    assert "slurm launch, 2 process(es)" in (out_dir / "log.txt").read_text()
    records = read_metrics(out_dir)
    [train], [val] = _split(records, "train"), _split(records, "val")
    assert train["step"] == 1436 // (32 * 2), "two ranks share the epoch: a global batch of 2 x 32"
    assert val["samples"] == VAL_IMAGES == 361
    assert (out_dir / "checkpoints" / "ckpt_ep_001.pth.tar").is_file()
    assert (out_dir / "best.pth.tar").is_file()
    assert load_checkpoint(str(out_dir / "checkpoints" / "ckpt_ep_001.pth.tar"))["world_size"] == 2


@pytest.mark.slow
def test_test_net_gives_the_training_runs_val_numbers_for_world_size_1_2_3(slurm_run, tmp_path):
    # The 2-rank training run's checkpoint, evaluated by 1, 2 and 3 processes. 361 val images are
    # divisible by neither 2 nor 3: an image lost or counted twice shows in the sample count and in
    # the loss sum, whatever the accuracy (so no accuracy floor: it would depend on the CPU).
    weights = str(slurm_run / "checkpoints" / "ckpt_ep_001.pth.tar")

    def evaluate(world: int) -> dict:
        out_dir = tmp_path / f"ws{world}"
        args = ("OUT_DIR", str(out_dir), "MODEL.WEIGHTS", weights, *FAST)
        assert_ok(in_process(TEST, *args) if world == 1 else run_torchrun(world, TEST, *args, timeout=400))
        [record] = _split(read_metrics(out_dir), "test")
        return record

    results = {world: evaluate(world) for world in (1, 2, 3)}
    for world in (2, 3):
        for key in ("top1", "topk", "samples"):
            assert results[world][key] == results[1][key], (key, world, results)
        assert results[world]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
    assert results[1]["samples"] == VAL_IMAGES, "every val image counted once, none padded or dropped"
    # The val numbers the 2-rank run reported are those of the weights it saved: evaluating the
    # checkpoint finds them again (BatchNorm statistics included, hence the loss).
    [val] = _split(read_metrics(slurm_run), "val")
    assert (val["top1"], val["topk"], val["samples"]) == (results[1]["top1"], results[1]["topk"], VAL_IMAGES)
    assert val["loss"] == pytest.approx(results[1]["loss"], rel=1e-5)


def test_test_net_without_weights_exits_2_naming_model_weights(tmp_path):
    result = in_process(TEST, "OUT_DIR", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distribuuuu: error:") and "MODEL.WEIGHTS" in lines[0], lines


@pytest.fixture(scope="module")
def utils_and_teardown_job(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """One 2-process torchrun job (the launcher's environment, real gloo, DDP): the utils example
    (utils_job.py), then train_model in the same group. Its result, the example's and the run's folders."""
    tmp_path = tmp_path_factory.mktemp("utils_teardown")
    utils_out, run_out = tmp_path / "utils", tmp_path / "run"
    utils_out.mkdir()
    args = [str(utils_out), *FAST, *DUMMY_OPTS, "OUT_DIR", str(run_out)]  # the loop, not the data
    return run_torchrun(2, TEARDOWN_JOB, *args, timeout=300, env=clean_env()), utils_out, run_out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_train_model_ends_its_process_group_before_it_returns(utils_and_teardown_job):
    """Nothing of the run (the stall reporter's view of it held DDP, whose reducer holds the group)
    may keep the process group alive past train_model: its gloo threads then ended during interpreter
    shutdown, which now and then aborted a rank that had trained to the end ("terminate called
    without an active exception")."""
    result, _, run_out = utils_and_teardown_job
    assert_ok(result)
    left = [line for line in result.stdout.splitlines() if line.startswith("gloo threads left:")]
    assert left == ["gloo threads left: []"] * 2, result.stdout[-2000:]
    assert "torchrun launch, 2 process(es)" in (run_out / "log.txt").read_text()


# ------------------------------------------------------------------------------------------------
# distribuuuu.utils in a user's own script
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_utils_job_runs_under_torchrun_with_two_processes(utils_and_teardown_job):
    # What only processes show: setup_distributed from torchrun's variables, DDP keeping the
    # replicas of two processes identical, rank 0's file read back by the other process.
    result, utils_out, _ = utils_and_teardown_job
    assert_ok(result)
    ok_lines = sorted(line.split()[1] for line in result.stdout.splitlines() if line.startswith("OK rank="))
    assert ok_lines == ["rank=0", "rank=1"], result.stdout
    assert "world=2" in result.stdout
    assert sorted(p.name for p in utils_out.iterdir()) == ["model.pth.tar"], "one file, written once, no temp left"
    assert load_checkpoint(str(utils_out / "model.pth.tar"))["saved_by"] == 0


@pytest.mark.parametrize("world", [2, 3])
def test_utils_reductions_and_rank_0s_checkpoint_on_every_rank(tmp_path, world):
    """distribuuuu.utils' collectives on every rank of a threaded process group, against sums by hand."""
    path = str(tmp_path / "model.pth.tar")

    def rank_job(rank: int) -> dict:
        assert (utils.get_rank(), utils.get_world_size(), utils.is_main_process()) == (rank, world, rank == 0)
        summed = utils.all_reduce_sum(torch.tensor([rank + 1.0])).item()
        [mean] = utils.scaled_all_reduce([torch.tensor([float(rank)])])
        gathered = utils.all_gather_object({"rank": rank})
        chosen = utils.broadcast_object(f"from {rank}")
        weights = torch.full((3,), float(rank))  # each rank its own: only rank 0's may land in the file
        utils.save_checkpoint({"weights": weights, "saved_by": rank}, path)
        utils.barrier()
        state = utils.load_checkpoint(path)
        return {"sum": summed, "mean": mean.item(), "gathered": gathered, "chosen": chosen, "state": state}

    for result in on_ranks(world, rank_job):
        assert result["sum"] == sum(r + 1 for r in range(world))
        assert result["mean"] == sum(range(world)) / world
        assert result["gathered"] == [{"rank": r} for r in range(world)]
        assert result["chosen"] == "from 0"
        assert result["state"]["saved_by"] == 0 and torch.equal(result["state"]["weights"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth.tar"], "one file, written once, no temp left"
