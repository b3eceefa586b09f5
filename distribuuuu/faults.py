"""Fault handling: preemption signals, requeue, non-finite losses, and per-rank RNG state."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger

logger = get_logger("faults")

# Exit code of a run that stopped on a preemption signal after writing its checkpoint:
# EX_TEMPFAIL from sysexits.h, "temporary failure, the user is invited to retry".
EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the tools exit with EXIT_PREEMPTED."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names epoch and step."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the step."""


# How long a rank whose collective failed waits for the other ranks to report the same failure.
PEER_REPORT_S = 5.0
_FAILED_KEY = "distribuuuu/collective_failed"
# What gloo, NCCL and the store say when a peer is gone or late (their errors name no rank).
_COMM_FAILURE = re.compile(
    r"timed? ?out|timeout|closed by peer|connection|pair closure|broken pipe|nccl|gloo|store", re.IGNORECASE
)


def is_comm_failure(e: BaseException) -> bool:
    """True for the errors of a failed or timed-out collective (not, say, a shape error)."""
    return isinstance(e, dist.DistError) or bool(_COMM_FAILURE.search(str(e)))


def silent_ranks(rank: int, world_size: int, wait_s: float = PEER_REPORT_S) -> list[int] | None:
    """After a failed collective, the ranks that do not report a failure too: the stalled or dead ones.

    gloo and NCCL name an address at best, never the rank that stopped answering. Every rank whose
    collective fails writes a key to the process group's store, which keeps answering while a
    worker is stopped (it lives in torchrun's agent, or in rank 0); ranks that have written none
    after ``wait_s`` are stuck elsewhere or gone. None when the store cannot tell (no process
    group, or the store itself does not answer, e.g. because rank 0 hosts it and is the one stuck).
    """
    if not (dist.is_available() and dist.is_initialized()) or world_size < 2:
        return None
    result: list[list[int]] = []
    # torchrun's static rendezvous keeps one store across restarts: keys are per attempt.
    prefix = f"{_FAILED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def report_and_poll() -> None:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                result.append(missing)
                return
            time.sleep(0.2)

    # A thread, because a store op on a store that does not answer blocks for the long timeout.
    thread = threading.Thread(target=_quietly, args=(report_and_poll,), daemon=True)
    thread.start()
    try:
        thread.join(wait_s + 2.0)
    except Exception:  # a signal handler raised meanwhile (DataLoader's SIGCHLD): keep the first error
        return None
    return result[0] if result else None


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # the store is gone too: silent_ranks returns None
        pass


def collective_error(e: BaseException, rank: int, world_size: int, what: str, timeout_s: float) -> CollectiveError:
    """A one-line CollectiveError naming this rank, what failed (with epoch and step) and the silent peers."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))  # drop gloo's "[/path/to/pair.cc:561]" prefix
    if not is_comm_failure(e):
        return CollectiveError(f"rank {rank}: {what} failed: {first}")
    silent = silent_ranks(rank, world_size)
    if silent:
        peers = f"rank(s) {silent} did not report the failure within {PEER_REPORT_S:g}s: stalled or dead"
    elif silent == []:
        peers = "every rank saw it fail"
    else:
        peers = "could not tell which rank stalled"
    return CollectiveError(f"rank {rank}: {what} failed (DIST.TIMEOUT_S={timeout_s:g}): {peers}; backend: {first}")


class PreemptionHandler:
    """Turn SIGTERM/SIGUSR1 into a flag the trainer checks at its synchronisation points.

    The handler only sets a flag (nothing unsafe inside a signal handler); the ranks agree on the
    stop at the next PRINT_FREQ step, where they already all-reduce metrics. If that has not
    happened within ``grace_s`` (a peer died, a collective hangs), the process exits hard, so a
    job never outlives its scheduler's kill timer stuck in a collective.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("received %s: stopping at the next synchronised step", self.signal_name)
        self._timer = threading.Timer(self.grace_s, self._hard_exit)
        self._timer.daemon = True
        self._timer.start()

    def _hard_exit(self) -> None:
        logger.error("no synchronised stop within %ss of %s: exiting hard", self.grace_s, self.signal_name)
        os._exit(EXIT_PREEMPTED)

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is threading.main_thread():
            for name in PREEMPT_SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def stop_requested_by_peer(self) -> None:
        """Record that this rank stops for another rank's signal (so __exit__ keeps the handlers)."""
        if not self.requested:
            self.signal_name = "a peer's signal"

    def __exit__(self, *exc) -> None:
        if self.requested:
            # Stopping: ignore further signals (the hard-exit timer stays) until the process exits,
            # since torchrun sends SIGTERM to the workers still running once one has exited; with
            # the default action, that signal would kill a worker that already wrote its checkpoint
            # and turn its exit code 75 into -15. SIG_IGN, not our handler: Python's finalisation
            # resets Python-level handlers to the default action, but leaves SIG_IGN in place.
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            return
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def ignore_preemption_signals(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: a worker ignores preemption signals unless its trainer sends them.

    torchrun forwards a signal to each worker's whole process group, and Slurm signals every
    process of a step: a DataLoader worker killed by it would crash the trainer before that
    reaches its checkpoint. SIGUSR1 is ignored outright. SIGTERM cannot be: the DataLoader (and
    multiprocessing at exit) stop workers with it, and a worker that ignored it would hang the
    exit. So SIGTERM is blocked and a thread obeys it only when the sender is the parent trainer.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # not on macOS: keep SIGTERM's default there
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit it
    threading.Thread(target=_obey_sigterm_from, args=(os.getppid(),), daemon=True).start()


def _obey_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            # As torch's own worker SIGTERM handler does for its parent: a clean exit, which the
            # DataLoader's SIGCHLD check does not report as a crash.
            os._exit(0)


def requeue_slurm_job() -> None:
    """Ask Slurm to requeue this job (``scontrol requeue $SLURM_JOB_ID``), if inside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.warning("DIST.REQUEUE is on but SLURM_JOB_ID is not set: not requeueing")
        return
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        logger.info("requeued Slurm job %s", job_id)
    except (OSError, subprocess.SubprocessError) as e:
        logger.error("scontrol requeue %s failed: %s", job_id, e)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict:
    """This process's RNG states as tensors and ints, which load under weights_only=True."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what capture_rng_state returned."""
    torch.set_rng_state(state["torch"].cpu())  # RNG states are CPU byte tensors, even CUDA's
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
