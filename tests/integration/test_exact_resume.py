"""Exact resume in one process: deterministic preemption (SIGTERM, SIGUSR1, Ctrl-C), with and without
DataLoader workers, a kill during a background checkpoint write, an automatic resume after an epoch,
each to the bit-identical weights of an uninterrupted run (tests/fault_helpers.py); and a resume with
another optimizer refused in one line unless TRAIN.LOAD_OPT is False.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
from pathlib import Path

import pytest
from fault_helpers import (
    ENV,
    INTERRUPTED,
    ONE,
    RESUMED,
    STEPS_ONE,
    _assert_same_weights,
    _final_state,
    _mid_epoch_checkpoints,
    _train_epochs,
)
from helpers import TINY_TRAIN, Started, assert_ok, clean_env, in_process, python, read_metrics, run

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("plain_logging")


@pytest.fixture(scope="module")
def reference_one_dir(tmp_path_factory) -> Path:
    """OUT_DIR of an uninterrupted single-process run (WORKERS 0): the reference of every resume of ONE."""
    out = tmp_path_factory.mktemp("reference_one")
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *ONE, env=ENV))  # the resumed runs: fresh processes
    # TRAIN.KEEP_CKPTS 3 (TINY's) of the 8 mid-epoch and 2 epoch-end checkpoints; best kept apart.
    kept = [ckpt.checkpoint_name(2, 30), ckpt.checkpoint_name(2, 40), ckpt.checkpoint_name(2)]
    assert [Path(p).name for p in ckpt.list_checkpoints(str(out / "checkpoints"))] == kept
    assert (out / ckpt.BEST_NAME).is_file()
    return out


@pytest.fixture(scope="module")
def reference_one(reference_one_dir) -> dict:
    """Final state of the uninterrupted single-process run."""
    return _final_state(reference_one_dir)


@pytest.fixture(scope="module")
def stopped_after_epoch_1(tmp_path_factory) -> Path:
    """OUT_DIR of a run of ONE stopped by TRAIN.STOP_AFTER_EPOCHS 1 (tests resume a copy of it)."""
    out = tmp_path_factory.mktemp("stopped_after_epoch_1")
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *ONE, "TRAIN.STOP_AFTER_EPOCHS", "1", env=ENV))
    assert _train_epochs(out) == [1], "TRAIN.STOP_AFTER_EPOCHS 1 stopped after epoch 1"
    return out


# ------------------------------------------------------------------------------------------------
# Exact resume in one process: deterministic preemption, with and without DataLoader workers
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_checkpoints_at_the_agreed_step_exits_130_in_one_line_and_resumes_to_the_same_weights(
    tmp_path, reference_one
):
    out = tmp_path / "run"
    # A terminal's Ctrl-C reaches its whole foreground process group: the trainer and its
    # DataLoader workers (TRAIN.WORKERS 2), which leave it to the trainer.
    cmd = python(TINY_TRAIN, "OUT_DIR", str(out), *ONE, "TRAIN.WORKERS", "2")
    with Started(cmd, ENV) as job:
        job.wait_until(lambda: _mid_epoch_checkpoints(out), 300, "a mid-epoch checkpoint")
        os.killpg(job.pid, signal.SIGINT)
        result = job.result(300)
    assert result.returncode == 130, job.tail()
    assert [line for line in result.stderr.splitlines() if line.strip()] == [INTERRUPTED.search(result.stderr)[0]]
    epoch, step = (int(g) for g in INTERRUPTED.search(result.stderr).groups())
    assert step % 5 == 0 or step % 10 == 0 or step == STEPS_ONE, f"step {step} is not a sync point"
    assert f"Ctrl-C (SIGINT): checkpointing at epoch {epoch}, step {step}" in (out / "log.txt").read_text()
    assert load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(epoch, step)))["step_in_epoch"] == step

    resumed = in_process(TINY_TRAIN, "OUT_DIR", str(out), *ONE, env=ENV)
    assert_ok(resumed)
    assert RESUMED.search(resumed.stdout)[1].endswith(ckpt.checkpoint_name(epoch, step))
    _assert_same_weights(_final_state(out), reference_one)


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers,sig,truncate_newest", [(0, "SIGTERM", False), (2, "SIGUSR1", True)], ids=["workers0", "workers2-truncated"]
)
def test_preempted_run_resumes_to_bit_identical_weights(tmp_path, reference_one, workers, sig, truncate_newest, caplog):
    out = tmp_path / "run"
    args = ["OUT_DIR", str(out), *ONE, "TRAIN.WORKERS", str(workers)]
    signal_after = STEPS_ONE + 13  # the signal after step 13 of epoch 2 ...
    stop_step = math.ceil(13 / 5) * 5  # ... stops at its next PRINT_FREQ sync point
    # A stand-in for Slurm's scontrol records the requeue that DIST.REQUEUE asks for.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "requeued"}\n')
    (fake_bin / "scontrol").chmod(0o755)
    env = clean_env(
        FAULT_SIGNAL_AT_STEP=str(signal_after),
        FAULT_SIGNAL=sig,
        SLURM_JOB_ID="4242",
        PATH=f"{fake_bin}:{os.environ['PATH']}",
    )
    preempted = run(python(TINY_TRAIN, *args, "DIST.REQUEUE", "True"), timeout=300, env=env)
    assert preempted.returncode == 75, preempted.stderr[-3000:]
    assert f"preempted at epoch 2, step {stop_step}" in preempted.stderr
    assert f"preemption ({sig}): checkpointing at epoch 2, step {stop_step}" in preempted.stdout
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    newest = out / "checkpoints" / ckpt.checkpoint_name(2, stop_step)
    periodic = out / "checkpoints" / ckpt.checkpoint_name(2, 10)  # TRAIN.CKPT_PERIOD_ITERS 10
    assert newest.is_file() and periodic.is_file()
    expected = newest
    if truncate_newest:
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
        expected = periodic

    resumed = in_process(TINY_TRAIN, *args, env=ENV)
    assert_ok(resumed)
    assert RESUMED.search(resumed.stdout)[1] == str(expected)
    if truncate_newest:
        # Said before the run's logging is set up: Python's last-resort handler prints it in a process of
        # its own; in this one, pytest's handler takes it.
        assert f"checkpoint {newest} is unreadable" in resumed.stdout + resumed.stderr + caplog.text
        assert not newest.exists() and Path(f"{newest}.corrupt").is_file()
    assert _train_epochs(out) == [1, 2]
    _assert_same_weights(_final_state(out), reference_one)


@pytest.mark.slow
def test_a_kill_during_a_background_checkpoint_write_resumes_from_the_previous_one(tmp_path, reference_one):
    out, marker = tmp_path / "run", tmp_path / "stalled"
    args = ["OUT_DIR", str(out), *ONE]
    stalled, previous = ckpt.checkpoint_name(1, 20), ckpt.checkpoint_name(1, 10)  # TRAIN.CKPT_PERIOD_ITERS 10
    env = clean_env(FAULT_STALL_CHECKPOINT=stalled, FAULT_STALL_MARKER=str(marker))
    with Started(python(TINY_TRAIN, *args), env) as job:
        job.wait_until(marker.exists, 300, "the stalled checkpoint write")
        # Training went on while the write stood still: the next PRINT_FREQ window (step 25) is logged.
        job.wait_until(lambda: "step 25/" in job.out.read_text(), 300, "a step logged during the write")
        os.killpg(job.pid, signal.SIGKILL)
        job.result(60)
    assert marker.read_text() == "checkpoint-writer", "the file was written by the background writer"
    names = os.listdir(out / "checkpoints")
    assert stalled not in names and any(n.startswith(f".{stalled}.") for n in names), names  # its partial temporary
    resumed = in_process(TINY_TRAIN, *args, env=ENV)
    assert_ok(resumed)
    assert RESUMED.search(resumed.stdout)[1] == str(out / "checkpoints" / previous)
    assert not [n for n in os.listdir(out / "checkpoints") if n.endswith(".part")], "the next write pruned it"
    _assert_same_weights(_final_state(out), reference_one)


@pytest.mark.slow
def test_auto_resume_after_an_epoch_continues_exactly_like_an_uninterrupted_run(
    tmp_path, stopped_after_epoch_1, reference_one_dir, reference_one
):
    out = tmp_path / "run"
    shutil.copytree(stopped_after_epoch_1, out)
    second = in_process(TINY_TRAIN, "OUT_DIR", str(out), *ONE, env=ENV)
    assert_ok(second)
    resumed = RESUMED.search(second.stdout)
    assert resumed, second.stdout[-3000:]
    assert (resumed[1], resumed[2], resumed[3]) == (str(out / "checkpoints" / ckpt.checkpoint_name(1)), "2", "0")
    assert "epoch 1/2" not in second.stdout, "the second invocation must not train epoch 1 again"
    train = [r for r in read_metrics(out) if r["split"] == "train"]
    reference = [r for r in read_metrics(reference_one_dir) if r["split"] == "train"]
    assert [r["epoch"] for r in train] == [1, 2]
    assert [r["step"] for r in train] == [r["step"] for r in reference]
    assert [r["lr"] for r in train] == pytest.approx([r["lr"] for r in reference], rel=1e-12)
    _assert_same_weights(_final_state(out), reference_one)


@pytest.mark.slow
def test_resume_with_another_optimizer_is_one_clear_error_and_load_opt_false_resumes(tmp_path, stopped_after_epoch_1):
    out = tmp_path / "run"
    shutil.copytree(stopped_after_epoch_1, out)
    args = ["OUT_DIR", str(out), *ONE]
    newest = out / "checkpoints" / ckpt.checkpoint_name(1)

    # Another optimizer is another experiment: stopped before anything is written, naming the way out.
    changed = in_process(TINY_TRAIN, *args, "OPTIM.OPTIMIZER", "adamw", env=ENV)
    assert changed.returncode == 2, changed.stderr[-3000:]
    errors = [line for line in changed.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and f"({newest}): OPTIM.OPTIMIZER: 'sgd' -> 'adamw'" in errors[0], changed.stderr[-3000:]
    assert "TRAIN.LOAD_OPT False continues from its weights" in errors[0]
    assert "Traceback" not in changed.stderr and _train_epochs(out) == [1]

    weights_only = in_process(TINY_TRAIN, *args, "OPTIM.OPTIMIZER", "adamw", "TRAIN.LOAD_OPT", "False", env=ENV)
    assert_ok(weights_only)
    assert _train_epochs(out) == [1, 2], "epoch 2 continues from epoch 1's weights"
