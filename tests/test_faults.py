"""Faults: killed, preempted and stalled ranks; corrupt, malicious and unwritable checkpoints; NaN losses.

The training jobs run ``tests/scripts/tiny_train.py``: ``tools/train_net.py``'s entry point with
tests/models.py's tiny CNN (so an epoch costs about a second) and fault injection at exact steps. Every
resumed run is compared with an uninterrupted run of the same configuration: the weights must be
bit-identical, which holds only if model, optimizer, EMA, LR position, RNG states and the sampler
position all came back exactly.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path

import models
import pytest
import torch
from helpers import (
    DDP_FSDP_REL,
    FAST,
    REPO,
    TINY_TRAIN,
    Payload,
    PlainState,
    Started,
    assert_ok,
    clean_env,
    in_process,
    python,
    read_metrics,
    run,
    run_torchrun,
    torchrun,
)

from distribuuuu import cli, startup, trainer, utils
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import CheckpointError, find_resumable, load_checkpoint, save_checkpoint
from distribuuuu.checkpointing.sharded import load_states, save_states
from distribuuuu.config import ConfigError
from distribuuuu.files import write_failure
from distribuuuu.runtime import preemption
from distribuuuu.runtime.launcher import find_free_port
from distribuuuu.runtime.preemption import PreemptionHandler

DIGITS = str(REPO / "data" / "digits")
# Mixup draws from the global RNG and EMA has its own state: an exact resume must restore both.
# Three checkpoints kept (the default keeps one): the resumes below fall back to an older one.
TINY = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "2",
    "DATA.MIXUP_ALPHA", "0.2", "OPTIM.EMA_DECAY", "0.9", "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS,
    "TRAIN.KEEP_CKPTS", "3",
]  # fmt: skip
ONE = [*TINY, "TRAIN.PRINT_FREQ", "5", "TRAIN.CKPT_PERIOD_ITERS", "10"]
# 2 ranks: one epoch of 22 steps (the single-process runs cover resuming into a later epoch).
TWO = [*TINY, "TRAIN.PRINT_FREQ", "3", "TRAIN.CKPT_PERIOD_ITERS", "4", "TRAIN.WORKERS", "1", "OPTIM.MAX_EPOCH", "1"]
STEPS_ONE = 1436 // 32  # optimizer steps per epoch: train images // (TRAIN.BATCH_SIZE x ranks)
# pytorch/pytorch#135712: torchrun's default (static) rendezvous keeps its store across restarts,
# and a restarted round may read its peers' stale gloo addresses ("connectFullMesh failed ...
# Connection refused", or a hang). The c10d rendezvous with this variable gives each round its own.
ENV = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
RESUMED = re.compile(r"resumed from (\S+) at epoch (\d+), step (\d+)")


pytestmark = pytest.mark.usefixtures("plain_logging")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _mid_epoch_checkpoints(out: Path) -> list[str]:
    """Finished mid-epoch checkpoints (files or sharded directories; not a temporary being written)."""
    names = os.listdir(out / "checkpoints") if (out / "checkpoints").is_dir() else []
    return [n for n in names if "_it_" in n and n.endswith((".pth.tar", ".dcp"))]


def _final_state(out: Path, epochs: int = 2) -> dict:
    return load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(epochs)))


def _assert_same_weights(a: dict, b: dict, rel: float = 0.0) -> None:
    """Model, EMA and optimizer tensors bit-identical (torch.equal, not allclose), or within ``rel``
    of each tensor's largest absolute value."""
    for name, x, y in (
        ("model", a["model"], b["model"]),
        ("ema", a["ema"]["module"], b["ema"]["module"]),
        ("momentum", a["optimizer"]["state"], b["optimizer"]["state"]),
    ):
        assert x.keys() == y.keys(), name
        for key in x:
            xs, ys = (x[key], y[key]) if name != "momentum" else (x[key]["momentum_buffer"], y[key]["momentum_buffer"])
            atol = rel * ys.float().abs().max().item() if ys.numel() else 0.0
            same = torch.equal(xs, ys) if not rel else torch.allclose(xs.float(), ys.float(), rtol=0, atol=atol)
            assert same, f"{name} {key} differs from the uninterrupted run"


def _train_epochs(out: Path) -> list[int]:
    return [r["epoch"] for r in read_metrics(out) if r["split"] == "train"]


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


INTERRUPTED = re.compile(
    r"^distribuuuu: interrupted \(Ctrl-C\) at epoch (\d+), step (\d+), its checkpoint written; exiting with 130 "
    r"\(run the same command again to resume there\)$",
    re.M,
)


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


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_second_ctrl_c_stops_at_once_and_one_within_a_second_is_the_same_one(monkeypatch, capsys):
    clock, exits = [100.0], []
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(preemption.os, "_exit", lambda code: exits.append(code))
    with PreemptionHandler(grace_s=60) as handler:
        signal.raise_signal(signal.SIGINT)
        assert handler.requested and handler.interrupted and not exits
        clock[0] += 0.5  # the terminal's Ctrl-C and the launcher's copy of it
        signal.raise_signal(signal.SIGINT)
        assert not exits
        clock[0] += 2.0
        signal.raise_signal(signal.SIGINT)
        assert exits == [130]
        handler._timer.cancel()
    assert "second Ctrl-C: stopped at once, without a checkpoint" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) == handler._handle, "after the stop, Ctrl-C still reaches the handler"


class _Loading(types.ModuleType):
    """A module still loading when Ctrl-C comes: a SIGINT arrives as each name is read, ``apart_s``
    after the previous one on ``clock``; what the SIGINT handler was then is kept in ``handlers``."""

    def __init__(self, name: str, presses: int = 1, clock: list | None = None, apart_s: float = 0.0):
        super().__init__(name)
        self.presses, self.clock, self.apart_s, self.handlers = presses, clock or [0.0], apart_s, []

    def __getattr__(self, name: str):
        if name.startswith("__"):  # what tools such as inspect ask of any module: not a name being imported
            raise AttributeError(name)
        for _ in range(self.presses):
            signal.raise_signal(signal.SIGINT)
            self.handlers.append(signal.getsignal(signal.SIGINT))
            self.clock[0] += self.apart_s
        return getattr(cli, name)


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("tool", ["train_net.py", "test_net.py"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_ctrl_c_while_torch_loads_is_one_line_from_rank_0_and_exit_130(monkeypatch, tool, rank):
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", _Loading("distribuuuu.cli"))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's process (not nohup's)
    env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_PORT="29500")
    result = in_process(str(REPO / "tools" / tool), env=env)
    assert (result.returncode, result.stdout) == (130, "")
    said = ["distribuuuu: interrupted (Ctrl-C) while starting; nothing saved"] if rank == 0 else []
    assert result.stderr.splitlines() == said


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("before", ["a terminal's default", "ignored (nohup)"])
def test_a_ctrl_c_during_the_import_is_held_to_its_end_unless_it_is_ignored(monkeypatch, before):
    handler = signal.default_int_handler if before == "a terminal's default" else signal.SIG_IGN
    loading = _Loading("distribuuuu.cli")
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", loading)
    signal.signal(signal.SIGINT, handler)
    if handler is signal.SIG_IGN:
        assert startup.imported("distribuuuu.cli", "run_tool") is cli.run_tool  # as if nothing was pressed
    else:
        with pytest.raises(SystemExit) as stopped:
            startup.imported("distribuuuu.cli", "run_tool")
        assert stopped.value.code == 130
        assert loading.handlers[0] not in (signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL), "held"
    assert signal.getsignal(signal.SIGINT) is handler, "put back after the import"


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_second_ctrl_c_stops_an_import_that_hangs(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(startup.time, "monotonic", lambda: clock[0])
    loading = _Loading("distribuuuu.cli", presses=3, clock=clock, apart_s=0.6)  # at 100, 100.6: one Ctrl-C
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", loading)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):  # the third, at 101.2 s: more than a second after the first
        startup.imported("distribuuuu.cli", "run_tool")
    assert len(loading.handlers) == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_tools_first_import_loads_no_torch():
    """What startup.imported needs is imported before torch: only a fresh interpreter shows it."""
    code = "import sys, distribuuuu.startup; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr[-2000:]


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


# ------------------------------------------------------------------------------------------------
# Exact resume in one process: deterministic preemption, with and without DataLoader workers
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# Non-finite losses
# ------------------------------------------------------------------------------------------------
def test_nan_loss_stops_naming_epoch_and_first_bad_step(tmp_path, monkeypatch):
    bad_step = 7  # forward calls 7 and 8 (= optimizer steps 7 and 8 of epoch 1) return NaN
    monkeypatch.setattr(models, "_NAN_CALLS", {bad_step, bad_step + 1})
    result = in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path), *ONE, "OPTIM.MAX_EPOCH", "1", env=ENV)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and f"non-finite loss at epoch 1, step {bad_step}:" in errors[0]
    # It raised at the first sync point after the NaN (step 10) instead of logging it and going on.
    assert "step 5/44" in result.stdout and "step 10/44" not in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_nan_policy_skip_skips_and_counts_the_bad_steps(tmp_path, monkeypatch):
    bad = [7, 8, 20]  # forward calls = optimizer steps of epoch 1
    monkeypatch.setattr(models, "_NAN_CALLS", set(bad))
    args = ["OUT_DIR", str(tmp_path), *ONE, "OPTIM.MAX_EPOCH", "1", "TRAIN.NAN_POLICY", "skip"]
    result = in_process(TINY_TRAIN, *args, env=ENV)
    assert_ok(result)
    train = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert [r["nonfinite_steps"] for r in train] == [len(bad)]
    assert "step 10/44" in result.stdout and "non-finite steps skipped 2" in result.stdout  # window 6-10
    # One NaN gradient applied would have made every weight NaN: the steps were really skipped.
    final = load_checkpoint(str(tmp_path / "checkpoints" / ckpt.checkpoint_name(1)))
    assert all(torch.isfinite(t).all() for t in final["model"].values())


# ------------------------------------------------------------------------------------------------
# Checkpoint files: truncated, malicious, bit-flipped, failed writes; unwritable OUT_DIR
# ------------------------------------------------------------------------------------------------
def _tiny_state(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value)}, "epoch": int(value)}


def test_find_resumable_moves_broken_newest_aside_and_falls_back(tmp_path, caplog):
    paths = [tmp_path / ckpt.checkpoint_name(e) for e in (1, 2, 3)]
    for e, p in enumerate(paths, 1):
        save_checkpoint(_tiny_state(e), str(p))
    paths[2].write_bytes(paths[2].read_bytes()[:100])  # truncated
    paths[1].write_bytes(b"")  # empty
    with caplog.at_level("WARNING"):
        assert find_resumable(str(tmp_path)) == str(paths[0])
    for broken in paths[1:]:
        assert not broken.exists() and Path(f"{broken}.corrupt").is_file()
        assert any(str(broken) in r.getMessage() and "moved it aside" in r.getMessage() for r in caplog.records)
    assert find_resumable(str(tmp_path / "none")) is None


@pytest.mark.parametrize("kind", ["os.system", "open"])
def test_checkpoint_that_would_run_code_is_refused(tmp_path, kind):
    marker = tmp_path / "pwned"
    payload = Payload(os.system, (f"touch {marker}",)) if kind == "os.system" else Payload(open, (str(marker), "w"))
    path = tmp_path / "evil.pth.tar"
    torch.save({"model": {"w": torch.zeros(2)}, "extra": payload}, path)
    with pytest.raises(CheckpointError, match=f"refusing to load {re.escape(str(path))}") as refused:
        load_checkpoint(str(path))
    assert not marker.exists()
    named = f"GLOBAL {payload.fn.__module__}.{payload.fn.__name__}"  # what torch refused: posix.system, io.open
    assert f"weights_only=True does not allow ({named}); if you trust its source" in str(refused.value)


@pytest.mark.parametrize("read", ["whole", "resume"])
def test_a_sharded_checkpoint_that_would_run_code_is_refused(tmp_path, read):
    """DCP itself unpickles a checkpoint's non-tensor entries with weights_only=False: read whole
    (evaluation, MODEL.WEIGHTS, the converter) or resumed, a .dcp is refused as a file is."""
    marker, path = tmp_path / "pwned", tmp_path / "evil.dcp"
    save_states(str(path), {"model": PlainState({"w": torch.zeros(2), "note": Payload(open, (str(marker), "w"))})}, {})
    with pytest.raises(CheckpointError, match=f"^refusing to load {re.escape(str(path))}: .*weights_only=True"):
        if read == "whole":
            load_checkpoint(str(path))
        else:
            load_states(str(path), {"model": PlainState({"w": torch.ones(2), "note": None})})
    assert not marker.exists()


def test_train_net_refuses_malicious_weights_in_one_line(tmp_path, capsys):
    """train_net.py's own entry point (cli.run_tool(train_model)), in this process."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth.tar"
    torch.save({"model": Payload(os.system, (f"touch {marker}",))}, path)
    args = ["OUT_DIR", str(tmp_path / "out"), *FAST, "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]
    assert cli.run_tool(trainer.train_model, [*args, "MODEL.WEIGHTS", str(path)]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and f"refusing to load {path}" in errors[0], err[-3000:]
    assert "Traceback" not in err and not marker.exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "nothing trained"


@pytest.mark.parametrize("failure", ["truncated", "EIO"])
def test_a_checkpoint_a_key_names_is_bad_input_unless_the_machine_failed_to_read_it(tmp_path, monkeypatch, failure):
    path = str(tmp_path / "ckpt.pth.tar")
    save_checkpoint({"model": {"w": torch.zeros(4)}}, path)
    if failure == "truncated":
        with open(path, "r+b") as f:
            f.truncate(100)
    else:

        def failing_disk(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(torch, "load", failing_disk)
    raised = ConfigError if failure == "truncated" else CheckpointError  # exit 2, or a failed run's exit 1
    with pytest.raises(raised) as caught, ckpt.named_by("MODEL.WEIGHTS"):
        load_checkpoint(path)
    assert type(caught.value) is raised and f"checkpoint {path} is unreadable" in str(caught.value)


def test_the_original_distribuuuus_load_checkpoint_call_says_how_to_load_a_model(tmp_path):
    path = str(tmp_path / "ckpt.pth.tar")
    model = torch.nn.Linear(2, 2)
    save_checkpoint({"model": model.state_dict()}, path)
    with pytest.raises(TypeError, match=r"model.load_state_dict\(load_checkpoint\(path\)\['model'\]\)"):
        utils.load_checkpoint(path, model)  # the original's (path, model): a model is no map_location
    model.load_state_dict(utils.load_checkpoint(path)["model"])  # what the message says works


def test_flipped_bit_in_tensor_data_fails_the_checksum(tmp_path):
    path = tmp_path / "ckpt.pth.tar"
    weights = torch.arange(256, dtype=torch.float32)
    save_checkpoint({"model": {"w": weights}}, str(path))
    data = bytearray(path.read_bytes())
    offset = data.find(weights.numpy().tobytes())
    assert offset > 0
    data[offset + 513] ^= 0x04
    path.write_bytes(data)
    assert not torch.equal(load_checkpoint(str(path), verify=False)["model"]["w"], weights), "torch.load accepts it"
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))} fails its checksum"):
        load_checkpoint(str(path))


class _FullDisk:
    """A file that takes ``room`` bytes, then fails each write with ENOSPC, as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _fill_disk_in_torch_save(monkeypatch, room: int = 1000) -> dict:
    """Make the real torch.save write into a disk with ``room`` bytes left once ``state["full"]`` is set.

    torch.save then fails as it does on a full disk (torch 2.15: a RuntimeError "unexpected pos"
    of its zip writer, raised while handling the OSError), for single files and DCP's shards alike.
    """
    real_save, state = torch.save, {"full": False}

    def save(obj, f, *args, **kwargs):
        if state["full"]:
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as file:
                    return real_save(obj, _FullDisk(file, room), *args, **kwargs)
            f = _FullDisk(f, room)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return state


def test_failed_checkpoint_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / ckpt.checkpoint_name(1)
    save_checkpoint(_tiny_state(1.0), str(path))
    before = path.read_bytes()
    _fill_disk_in_torch_save(monkeypatch)["full"] = True
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {re.escape(str(path))}.*No space left"):
        save_checkpoint(_tiny_state(2.0), str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "no temp file left behind"
    assert load_checkpoint(str(path))["epoch"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_disk_full_during_a_checkpoint_stops_the_run_in_one_line_and_loses_nothing(tmp_path, monkeypatch, capsys, fmt):
    disk = _fill_disk_in_torch_save(monkeypatch)
    real_save_checkpoint = trainer.save_training_checkpoint

    def first_fits(run, checkpoints, *args, **kwargs):  # the disk fills up after the first checkpoint
        path = real_save_checkpoint(run, checkpoints, *args, **kwargs)
        checkpoints.wait()  # the first one is on disk: the next (background) write fails
        disk["full"] = True
        return path

    monkeypatch.setattr(trainer, "save_training_checkpoint", first_fits)
    out = tmp_path / "out"
    args = ["OUT_DIR", str(out), *FAST, "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "OPTIM.MAX_EPOCH", "1"]
    args += ["TRAIN.CKPT_PERIOD_ITERS", "1", "DIST.CKPT_FORMAT", fmt]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("distribuuuu: error:")]
    suffix = ".pth.tar" if fmt == "file" else ".dcp"
    failed = out / "checkpoints" / f"{ckpt.checkpoint_name(1, 2).removesuffix('.pth.tar')}{suffix}"
    assert len(errors) == 1 and str(failed) in errors[0] and "No space left on device" in errors[0], err[-3000:]
    assert "Traceback" not in err
    first = f"{ckpt.checkpoint_name(1, 1).removesuffix('.pth.tar')}{suffix}"
    assert sorted(os.listdir(out / "checkpoints")) == [first], "no temporary file or directory left behind"
    monkeypatch.undo()
    resumed = load_checkpoint(str(out / "checkpoints" / first))
    assert (resumed["epoch"], resumed["step_in_epoch"]) == (0, 1)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 4 MiB file system (tmpfs) at ``tmp_path/disk``, unmounted after; skipped where mount is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small file system here (root only): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path, leave: int = 64 << 10) -> None:
    """Take all but ``leave`` bytes of the file system of ``disk`` with one file."""
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def test_a_full_file_system_is_named_whatever_torch_says(small_disk):
    """A short write that torch reports without the OSError underneath (torch 2.14's zip writer
    writing to a path) is put down to the full file system it went to, with its free bytes."""
    _fill(small_disk, leave=0)
    try:
        with open(small_disk / "part", "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
    except OSError:
        pass
    from_torch = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    said = write_failure(from_torch, str(small_disk))
    assert said is not None and said.startswith("No space left on device (") and str(small_disk) in said, said
    (small_disk / "filler").unlink()  # room again: the same error is no longer a full disk
    assert write_failure(from_torch, str(small_disk)) is None


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_checkpoint_into_a_full_file_system_fails_in_one_line_and_keeps_the_last_one(small_disk, fmt):
    state = {"model": {"w": torch.arange(64 << 10, dtype=torch.float32)}, "epoch": 1}  # 256 KiB
    first, second = small_disk / f"ckpt_1.{fmt}", small_disk / f"ckpt_2.{fmt}"
    save = save_checkpoint if fmt == "file" else save_states_of
    save(state, str(first))
    _fill(small_disk)
    with pytest.raises(CheckpointError) as e:
        save(dict(state, epoch=2), str(second))
    assert "\n" not in str(e.value) and f"{second}" in str(e.value), str(e.value)
    assert re.search(r"No space left on device \(\d[\d,]* bytes free on the file system of ", str(e.value)), str(
        e.value
    )
    assert sorted(p.name for p in small_disk.iterdir()) == sorted([first.name, "filler"]), "nothing half-written"
    assert torch.equal(load_checkpoint(str(first))["model"]["w"], state["model"]["w"])


def test_a_sharded_checkpoint_is_read_whole_with_no_room_in_tmpdir(small_disk, tmp_path, monkeypatch):
    """Evaluation, MODEL.WEIGHTS and the converter read a .dcp whole into memory: a full TMPDIR
    (a cluster node's small /tmp) does not stop them, and nothing is written there."""
    state = {"model": {"w": torch.arange(64 << 10, dtype=torch.float32)}, "epoch": 3}  # 256 KiB
    save_states_of(state, str(tmp_path / "ckpt.dcp"))
    _fill(small_disk, leave=0)
    monkeypatch.setenv("TMPDIR", str(small_disk))
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    read = load_checkpoint(str(tmp_path / "ckpt.dcp"))
    assert torch.equal(read["model"]["w"], state["model"]["w"]) and read["epoch"] == 3
    assert [p.name for p in small_disk.iterdir()] == ["filler"]


def save_states_of(state: dict, path: str) -> None:
    """Write ``state``'s model dict as a one-rank sharded (DCP) checkpoint."""
    save_states(path, {"model": PlainState(state["model"])}, {"epoch": state["epoch"]})


def test_unwritable_out_dir_fails_before_training_with_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    args = ["OUT_DIR", str(out), "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"distribuuuu: error: OUT_DIR: cannot write to {out}" in err
    assert blocker.read_text() == "not a directory"


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


def test_an_error_inside_the_model_keeps_its_traceback(tmp_path):
    """Only failed collectives become one-line errors: a model's own bug must surface as raised."""
    from distribuuuu.models import register_model

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (32x48 and 64x10)")

    register_model("broken_forward")(lambda num_classes, pretrained=False: Broken())
    args = ["OUT_DIR", str(tmp_path), *FAST, "MODEL.ARCH", "broken_forward", "TRAIN.DATASET", DIGITS]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
        cli.run_tool(trainer.train_model, [*args, "TEST.DATASET", DIGITS])
    assert raised.traceback[-1].name == "forward", "the traceback ends where the model failed"
