"""Fault handling: preemption signals, requeue, non-finite losses, and per-rank RNG state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading

import numpy as np
import torch

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

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
