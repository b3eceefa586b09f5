"""Preemption and Ctrl-C: a signal becomes a flag the ranks agree on, then a checkpoint and an exit.

SIGTERM/SIGUSR1 (a scheduler's preemption): exit 75 and, if asked, a Slurm requeue. SIGINT (Ctrl-C,
or torchrun passing on the one it got): the same checkpoint, exit 130, no requeue; a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from distribuuuu.errors import EXIT_INTERRUPTED, SAME_CTRL_C_S
from distribuuuu.logger import get_logger
from distribuuuu.runtime.process_group import is_main_process

logger = get_logger("preemption")

# Exit code of a run that stopped on a preemption signal after writing its checkpoint:
# EX_TEMPFAIL from sysexits.h, "temporary failure, the user is invited to retry".
EXIT_PREEMPTED = 75

PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")
INTERRUPT = "SIGINT"


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the tools exit with ``exit_code``."""

    exit_code = EXIT_PREEMPTED
    how_to_resume = "resume with TRAIN.AUTO_RESUME True"


class Interrupted(Preempted):
    """Raised after the checkpoint a Ctrl-C asked for is written."""

    exit_code = EXIT_INTERRUPTED
    how_to_resume = "run the same command again to resume there"


class PreemptionHandler:
    """Turn SIGTERM/SIGUSR1/SIGINT into a flag the trainer checks at its synchronisation points.

    The handler only sets a flag (nothing unsafe inside a signal handler); the ranks agree on the
    stop at the next PRINT_FREQ step, where they already all-reduce metrics. If that has not
    happened within ``grace_s`` (a peer died, a collective hangs), the process exits hard, so a
    job never outlives its scheduler's kill timer stuck in a collective. A second Ctrl-C exits at
    once, without a checkpoint.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._interrupted_at: float | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def interrupted(self) -> bool:
        """True if this rank's own stop came from a Ctrl-C (SIGINT)."""
        return self._interrupted_at is not None

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._handle_interrupt()
        if self.requested:
            return
        self.signal_name = signal.Signals(signum).name
        if signum != signal.SIGINT:
            logger.warning("received %s: stopping at the next synchronised step", self.signal_name)
        self._timer = threading.Timer(self.grace_s, self._hard_exit)
        self._timer.daemon = True
        self._timer.start()

    def _handle_interrupt(self) -> None:
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            if not self.requested:
                logger.warning(
                    "Ctrl-C: checkpointing at the next synchronised step (press Ctrl-C again to stop at once, unsaved)"
                )
        elif now - self._interrupted_at > SAME_CTRL_C_S:
            # print, not the logger: a handler may run while the logging lock is held (re-entrance)
            print("distribuuuu: second Ctrl-C: stopped at once, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)

    def _hard_exit(self) -> None:
        logger.error("no synchronised stop within %ss of %s: exiting hard", self.grace_s, self.signal_name)
        os._exit(EXIT_INTERRUPTED if self.interrupted else EXIT_PREEMPTED)

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is threading.main_thread():
            for name in (*PREEMPT_SIGNALS, INTERRUPT):
                sig = getattr(signal, name)
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    # Started in the background (nohup, a shell's `&`): Ctrl-C is not for it, and says so
                    logger.info("Ctrl-C (SIGINT) is ignored by this process, as it was started (nohup, a shell's &): "
                                "SIGTERM (kill PID) stops it at the next synchronised step, its checkpoint written")  # fmt: skip
                    continue
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
            # SIGINT keeps the handler: a second Ctrl-C still stops at once.
            for sig in self._previous:
                signal.signal(sig, self._handle if sig == signal.SIGINT else signal.SIG_IGN)
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the workers too: the trainer handles it
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


def stop_for_preemption(
    preempt: PreemptionHandler | None,
    position: str,
    save_checkpoint: Callable[[], object],
    requeue: bool,
    interrupted: bool = False,
) -> NoReturn:
    """At a synchronised step: checkpoint (``save_checkpoint``, on every rank), requeue if asked, raise Preempted.

    ``preempt`` is None on a rank without a handler (not the main thread): it follows a peer's signal.
    ``interrupted``: some rank got a Ctrl-C (the ranks agree on it): no requeue, Interrupted.
    """
    if preempt is not None:
        preempt.stop_requested_by_peer()  # a no-op on the ranks that got the signal themselves
    signal_name = preempt.signal_name if preempt is not None else "a peer's signal"
    logger.warning("%s (%s): checkpointing at %s", "Ctrl-C" if interrupted else "preemption", signal_name, position)
    save_checkpoint()  # returns once the checkpoint is complete on every rank
    if interrupted:
        raise Interrupted(f"interrupted (Ctrl-C) at {position}, its checkpoint written")
    if requeue:
        requeue_slurm_job()  # rank 0 alone
    raise Preempted(f"preempted at {position}")


def requeue_slurm_job() -> None:
    """Ask Slurm to requeue this job (``scontrol requeue $SLURM_JOB_ID``) from global rank 0, if inside one.

    Every rank calls it, once the checkpoint is complete on all of them; one request per job, not
    one per rank (64 ranks would send 64 requeues of the same job, one succeeding, 63 failing).
    """
    if not is_main_process():
        return
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.warning("DIST.REQUEUE is on but SLURM_JOB_ID is not set: not requeueing")
        return
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        logger.info("requeued Slurm job %s", job_id)
    except (OSError, subprocess.SubprocessError) as e:
        logger.error("scontrol requeue %s failed: %s", job_id, e)
