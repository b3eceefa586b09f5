"""Killed, preempted and stalled ranks of 2-process gloo jobs under torchrun: a SIGKILLed rank restarted
and resumed (DDP and FSDP), SIGTERM's checkpoint at the agreed step, exit 75 and requeue, Ctrl-C to
torchrun, a preempted process signalled again while exiting, and a stopped rank named by its missing
heartbeat. Every resumed run is compared with an uninterrupted one (tests/fault_helpers.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import (
    ENV,
    INTERRUPTED,
    RESUMED,
    TWO,
    _assert_same_weights,
    _final_state,
    _mid_epoch_checkpoints,
    _train_epochs,
)
from helpers import DDP_FSDP_REL, TINY_TRAIN, Started, assert_ok, clean_env, run_torchrun, torchrun

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint
from distribuuuu.runtime.launcher import find_free_port

pytestmark = pytest.mark.usefixtures("plain_logging")


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory) -> dict:
    """Final state of an uninterrupted 2-process torchrun run."""
    out = tmp_path_factory.mktemp("reference_two")
    assert_ok(run_torchrun(2, TINY_TRAIN, "OUT_DIR", str(out), *TWO, timeout=400))
    return _final_state(out, epochs=1)


# ------------------------------------------------------------------------------------------------
# Killed, preempted and stalled ranks (2-process gloo jobs under torchrun)
# ------------------------------------------------------------------------------------------------
def _restartable_job(out: Path, *args: str) -> list[str]:
    """A 2-rank tiny_train job that torchrun restarts once, with the c10d rendezvous (see ENV)."""
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", "--max-restarts=1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *rdzv]
    return [*torchrun, TINY_TRAIN, "OUT_DIR", str(out), *TWO, *args]


@pytest.mark.slow
def test_sigkilled_rank_is_restarted_by_torchrun_and_resumes_to_the_same_weights(tmp_path, reference_two):
    out = tmp_path / "run"
    with Started(_restartable_job(out), ENV) as job:
        job.wait_until(lambda: _mid_epoch_checkpoints(out), 300, "a mid-epoch checkpoint")
        first_round = job.workers()
        os.kill(first_round[1], signal.SIGKILL)
        result = job.result(400)
    assert_ok(result)
    resumed = RESUMED.search(result.stdout)
    assert resumed and "_it_" in resumed[1], f"no mid-epoch resume:\n{result.stdout[-3000:]}"
    assert _train_epochs(out) == [1]
    _assert_same_weights(_final_state(out, epochs=1), reference_two)


@pytest.mark.slow
def test_sigkilled_fsdp_rank_resumes_from_the_sharded_checkpoint_to_ddps_weights(tmp_path, reference_two):
    out = tmp_path / "run"
    with Started(_restartable_job(out, "DIST.STRATEGY", "fsdp"), ENV) as job:
        job.wait_until(lambda: _mid_epoch_checkpoints(out), 300, "a mid-epoch checkpoint")
        os.kill(job.workers()[1], signal.SIGKILL)
        result = job.result(400)
    assert_ok(result)
    resumed = RESUMED.search(result.stdout)
    assert resumed and resumed[1].endswith(".dcp") and "_it_" in resumed[1], (
        f"no sharded resume:\n{result.stdout[-3000:]}"
    )
    assert _train_epochs(out) == [1]
    # Each rank wrote its own shard; the directory loads whole (as test_net.py reads it).
    final = load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(1).replace(".pth.tar", ".dcp")))
    # fp32: FSDP2's reduce-scatter sums in another order than DDP's all-reduce (helpers.DDP_FSDP_REL).
    _assert_same_weights(final, reference_two, rel=DDP_FSDP_REL)


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_agreed_step_exits_75_is_requeued_once_and_resumes_to_the_same_weights(
    tmp_path, reference_two
):
    out, calls = tmp_path / "run", tmp_path / "scontrol_calls"
    # A stand-in for Slurm's scontrol appends one line per call: its arguments and the checkpoints
    # on disk at that moment.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f'#!/bin/sh\necho "$@" $(ls {out / "checkpoints"}) >> {calls}\n')
    (fake_bin / "scontrol").chmod(0o755)
    env = dict(ENV, SLURM_JOB_ID="4242", PATH=f"{fake_bin}:{os.environ['PATH']}")
    cmd = torchrun(2, TINY_TRAIN, "OUT_DIR", str(out), *TWO, "DIST.REQUEUE", "True")
    with Started(cmd, env) as job:
        job.wait_until(lambda: _mid_epoch_checkpoints(out), 300, "a mid-epoch checkpoint")
        # Signal the workers as Slurm does (every process of the step): torchrun then reports
        # their exit codes. (Signalling torchrun works too: it forwards SIGTERM to the workers.)
        for pid in job.workers().values():
            os.kill(pid, signal.SIGTERM)
        result = job.result(300)
    # torchrun itself exits 1 whenever a worker exits non-zero; its report names each exit code.
    assert result.returncode == 1, job.tail()
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", result.stderr, re.M) == ["75", "75"], result.stderr[-3000:]
    stop = re.search(r"preempted at epoch (\d+), step (\d+); exiting with 75", result.stderr)
    assert stop, result.stderr[-3000:]
    epoch, step = int(stop[1]), int(stop[2])
    # The ranks agree on stopping at a sync point: every PRINT_FREQ (3) and CKPT_PERIOD_ITERS (4)
    # steps, and the epoch's last (22).
    assert step % 3 == 0 or step % 4 == 0 or step == 1436 // 64, f"step {step} is not a sync point"
    # Each rank names the position it checkpoints at: rank 0 in log.txt, rank 1 on stderr. The
    # signals reach the two ranks one after the other, so a rank whose own SIGTERM lands after the
    # ranks agreed to stop names its peer's (both are right); one of them is always SIGTERM.
    said = rf"preemption \((SIGTERM|a peer's signal)\): checkpointing at epoch {epoch}, step {step}$"
    rank0 = re.findall(said, (out / "log.txt").read_text(), re.M)
    rank1 = re.findall(rf"\[rank 1 .*\] {said}", result.stderr, re.M)
    assert len(rank0) == len(rank1) == 1 and "SIGTERM" in rank0 + rank1, (rank0, rank1, result.stderr[-3000:])
    path = out / "checkpoints" / ckpt.checkpoint_name(epoch, step)
    state = load_checkpoint(str(path))
    assert (state["epoch"], state["step_in_epoch"], len(state["rng"])) == (epoch - 1, step, 2)
    # Rank 0 alone asks Slurm to requeue the job, once, when that checkpoint is whole on disk.
    [requeue] = calls.read_text().splitlines()
    assert requeue.split()[:2] == ["requeue", "4242"] and path.name in requeue.split()[2:], requeue

    resumed = run_torchrun(2, TINY_TRAIN, "OUT_DIR", str(out), *TWO, timeout=400)
    assert_ok(resumed)
    assert RESUMED.search(resumed.stdout)[1] == str(path)
    assert _train_epochs(out) == [1]
    _assert_same_weights(_final_state(out, epochs=1), reference_two)


@pytest.mark.slow
def test_ctrl_c_to_torchrun_checkpoints_every_rank_at_one_step_without_worker_tracebacks(tmp_path):
    out = tmp_path / "run"
    with Started(torchrun(2, TINY_TRAIN, "OUT_DIR", str(out), *TWO), ENV) as job:
        job.wait_until(lambda: _mid_epoch_checkpoints(out), 300, "a mid-epoch checkpoint")
        os.killpg(job.pid, signal.SIGINT)  # torchrun's group, as a terminal; it passes SIGINT on
        result = job.result(300)
    assert result.returncode != 0, job.tail()
    # torchrun reports the signal it got with a traceback of its own; the workers print one line.
    assert "KeyboardInterrupt" not in result.stderr and result.stderr.count("Traceback") <= 1, job.tail()
    stop = INTERRUPTED.search(result.stderr)
    assert stop and len(INTERRUPTED.findall(result.stderr)) == 1, job.tail()
    epoch, step = int(stop[1]), int(stop[2])
    # Every rank's state at that one step (a rank's RNG for each): what the SIGTERM test resumes from.
    state = load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(epoch, step)))
    assert (state["epoch"], state["step_in_epoch"], len(state["rng"])) == (epoch - 1, step, 2)


_STOPPING_PROCESS = """
import os, signal, sys, time
from distribuuuu.runtime.preemption import PreemptionHandler
try:
    with PreemptionHandler(60) as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        while not handler.requested:
            time.sleep(0.01)
        raise KeyboardInterrupt  # leaves the block as Preempted does
except KeyboardInterrupt:
    pass
print("exiting", flush=True)
sys.exit(75)
"""


def test_a_preempted_process_still_exits_75_when_signalled_again_while_exiting():
    # torchrun sends SIGTERM to the workers still running once one exits: a worker that already
    # checkpointed must exit 75 all the same, even while the interpreter shuts down (that race
    # turned rank 1's 75 into -15 in the test above).
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOPPING_PROCESS], stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        assert proc.stdout.readline().strip() == "exiting"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            os.kill(proc.pid, signal.SIGTERM)  # again and again, until it is gone
    finally:
        proc.kill()
    assert proc.wait(timeout=60) == 75


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_its_missing_heartbeat_and_fails_the_job_at_the_timeout(tmp_path):
    # NCCL's collectives raise nothing on a timeout (its watchdog aborts the process): the line that
    # names a stalled rank must not depend on the collective's error. Rank 1 stops itself (SIGSTOP:
    # its heartbeat thread stops with it) 2 s after step 5 (its heartbeat has sent that position by
    # then, however fast the steps), while rank 0 waits in the next all-reduce: the heartbeat names
    # rank 1 after DIST.STALL_S, the collective gives up after DIST.TIMEOUT_S and rank 0 exits.
    timeout_s, stall_s = 14, 3
    out = tmp_path / "run"
    cmd = torchrun(
        2, TINY_TRAIN, "OUT_DIR", str(out), *TWO, "DIST.TIMEOUT_S", str(timeout_s), "DIST.STALL_S", str(stall_s)
    )
    env = dict(ENV, FAULT_SIGNAL_AT_STEP="5", FAULT_SIGNAL_DELAY_S="2", FAULT_SIGNAL="SIGSTOP", FAULT_SIGNAL_RANK="1")
    named = re.compile(
        r"rank 0: rank\(s\) \[1\] sent no heartbeat for 3s \(DIST.STALL_S\): stalled or dead \(([^;]*)\);"
    )
    with Started(cmd, env) as job:
        job.wait_until(lambda: named.search(job.out.read_text()), 300, "the line naming rank 1")
        named_at = time.monotonic()
        workers = job.workers()
        rank0 = Path(f"/proc/{workers[0]}")
        job.wait_until(
            lambda: not rank0.exists() or "Z" in (rank0 / "stat").read_text().rsplit(")", 1)[1].split()[0],
            timeout_s + 60,
            "rank 0's exit",
        )
        ended_after = time.monotonic() - named_at
        # A stopped process keeps torchrun's SIGTERM pending: continue it, or torchrun waits 30 s
        # more before its SIGKILL.
        os.kill(workers[1], signal.SIGCONT)
        result = job.result(120)
    print(f"rank 0 exited {ended_after:.1f}s after the line naming rank 1 (DIST.TIMEOUT_S={timeout_s})")
    assert result.returncode != 0, job.tail()
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "sent no heartbeat" in line]
    assert len(lines) == 1, job.tail()
    assert re.fullmatch(
        rf"rank 1 on {re.escape(socket.gethostname())}, last beat at epoch 1, step \d+", named.search(lines[0])[1]
    )
    # Named within a few beats of the stop, long before the collective timeout ended the job; the
    # job then ends at the timeout (plus up to 5 s waiting for the peers to report, plus a loaded
    # machine's slack), not earlier and not never.
    assert timeout_s / 2 < ended_after <= timeout_s + 40, job.tail()
    error = re.search(r"distribuuuu: error: rank 0: (.*)", result.stderr)
    assert error, job.tail()
    assert re.search(
        rf"at epoch \d+, step \d+ failed \(DIST.TIMEOUT_S={timeout_s}\): rank\(s\) \[1\] did not report", error[1]
    )
