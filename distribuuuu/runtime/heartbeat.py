"""Heartbeats in the rendezvous store: the ranks that stopped answering, named before the collective times out.

NCCL's collectives are asynchronous: when one times out, its watchdog aborts the process, and no
exception ever reaches the code that would name the stalled rank (faults.py does that for gloo,
whose collectives raise). So every rank runs a thread that writes a heartbeat (a counter, its
host and its training position) to the store every ``stall_s / 4`` seconds and reads everyone's.
A rank whose heartbeat has not changed for ``stall_s`` (below DIST.TIMEOUT_S) is named in one
line, by the lowest-ranked rank that is still beating, whatever the backend.

What it catches: a process that is stopped (SIGSTOP, a frozen node), dead without its job ending
yet, or blocked in C code that holds the GIL. What it does not: a rank whose Python threads still
run but whose main thread is stuck (a deadlock that releases the GIL, an endless data wait, a
collective another rank never joins): its heartbeat goes on, and the collective timeout (with
faults.py's naming on gloo) remains the only guard there. By the same token a long checkpoint
write or evaluation never raises a false alarm: the thread beats while the main thread works.

The line is all it does: the job still ends when DIST.TIMEOUT_S runs out (NCCL's watchdog aborts,
gloo's collective raises and faults.py names the failure). A false alarm (a node swapping hard for
longer than ``stall_s``, then recovering) costs a line, never a run that would have finished.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Callable

import torch.distributed as dist

from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger

logger = get_logger("heartbeat")
_DONE = "done"  # the last value of a rank that stopped beating on purpose (cleanup_distributed)

# Where this process is in training (set by the trainer), sent with every heartbeat.
_position: Callable[[], str] = str


@contextlib.contextmanager
def reporting_position(where: Callable[[], str]) -> Iterator[None]:
    """Send ``where()`` (e.g. "epoch 2, step 40") with this rank's heartbeats while inside.

    A context, not a setter: ``where`` closes over the run (its model, and through DDP's reducer or
    FSDP's state, the process group). Left in a module global, it kept the process group alive past
    ``destroy_process_group``, and gloo's threads then ended during interpreter shutdown, which
    aborts the process now and then ("terminate called without an active exception").
    """
    global _position
    previous, _position = _position, where
    try:
        yield
    finally:
        _position = previous


def stall_seconds(stall_s: float, timeout_s: float) -> float:
    """DIST.STALL_S, or its default: half of DIST.TIMEOUT_S, at most 2 minutes."""
    return stall_s if stall_s > 0 else min(timeout_s / 2, 120.0)


class Heartbeat:
    """A daemon thread that beats for this rank and names the ranks whose heartbeat stopped."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, stall_s: float, timeout_s: float):
        self.rank, self.world_size, self.stall_s, self.timeout_s = rank, world_size, stall_s, timeout_s
        self.period = max(stall_s / 4, 0.05)
        # A store of its own (one connection per thread), whose operations give up quickly: a store
        # that does not answer must hold neither the thread nor the process's exit for long.
        self.store_timeout_s = min(max(self.period, 1.0), 5.0)
        self.store = store.clone()
        self.store.set_timeout(datetime.timedelta(seconds=self.store_timeout_s))
        # torchrun's agent keeps one store across restarts: keys are per attempt.
        prefix = f"distribuuuu/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.keys = [f"{prefix}/{r}" for r in range(world_size)]
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distribuuuu-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, which tells the others this rank stopped on purpose (within a store timeout)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.store_timeout_s + 1.0)

    def _run(self) -> None:
        beats, seen, named, store_failed = 0, {}, set(), False
        last_loop, first = time.monotonic(), True
        # The first beat at once: a rank that stalls within its first period must not read as "never beat".
        while first or not self._stop.wait(self.period):
            first = False
            now = time.monotonic()
            if now - last_loop > self.stall_s / 2:  # this process was stopped itself: it cannot judge
                seen = {}
            last_loop = now
            try:
                beats += 1
                self.store.set(self.keys[self.rank], f"{beats}|{self.host}|{_position()}")
                values = self._read()
                store_failed = False
            except Exception as e:  # the store is slow or gone: say so once, judge no one across the gap
                if not store_failed:
                    logger.warning(
                        "rank %d: heartbeat: the rendezvous store does not answer: %s", self.rank, first_line(e)
                    )
                seen, store_failed = {}, True
                continue
            for r, value in values.items():
                if seen.get(r, (None,))[0] != value or value == _DONE:  # a rank that finished is never late
                    seen[r] = (value, now)
            for r in range(self.world_size):
                seen.setdefault(r, (None, now))  # a rank not beating yet is timed from here
            stalled = [r for r in range(self.world_size) if now - seen[r][1] >= self.stall_s]
            beating = [r for r in range(self.world_size) if r not in stalled]
            if set(stalled) - named and beating and beating[0] == self.rank:
                self._name(stalled, {r: seen[r][0] for r in stalled})
            named = set(stalled)
        try:  # a rank that ends before the others (they still write a summary) is not stalled
            self.store.set(self.keys[self.rank], _DONE)
        except Exception:
            pass

    def _read(self) -> dict[int, str]:
        """Every rank's last heartbeat value (ranks that never beat are left out)."""
        if self.store.check(self.keys):
            return {r: v.decode() for r, v in enumerate(self.store.multi_get(self.keys))}
        return {r: self.store.get(k).decode() for r, k in enumerate(self.keys) if self.store.check([k])}

    def _name(self, stalled: list[int], last: dict[int, str | None]) -> None:
        def where(r: int) -> str:
            if last[r] is None:
                return f"rank {r} (never beat)"
            _, host, position = last[r].split("|", 2)
            return f"rank {r} on {host}" + (f", last beat at {position}" if position else "")

        logger.error(
            "rank %d: rank(s) %s sent no heartbeat for %gs (DIST.STALL_S): stalled or dead (%s); the job ends "
            "when the collective times out (DIST.TIMEOUT_S=%g)",
            self.rank, stalled, self.stall_s, "; ".join(map(where, stalled)), self.timeout_s,
        )  # fmt: skip
