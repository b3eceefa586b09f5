"""Checkpoint writes off the training's critical path: one write at a time in a thread.

Training hands over a host copy of its state (``host_copy``: the next optimizer step may change
the tensors while the file is written) and continues; the write runs in a ``BackgroundWriter``'s
thread. At most one write is in flight: the next one, the end of the run and a preemption first
wait for it (``wait``), and a write's error is raised there, as the write itself would have
raised it. ``concurrent.futures`` would keep a pool and its own exit hooks for one thread; the
join-and-raise is all this needs, hence the class.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
WRITER_NICENESS = 10  # the writer thread's nice value (training's is 0)


def host_copy(state: T) -> T:
    """``state`` (nested dicts, lists, tensors, plain values) with every tensor copied to host memory.

    A real copy for host tensors too (``.cpu()`` would return the very tensor the next step
    changes). One ``deepcopy`` keeps the structure whole: tensors two entries share stay shared,
    and the module versions a ``state_dict()`` records (``_metadata``) come along.
    """
    memo: dict[int, object] = {}

    def collect(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().to("cpu", copy=True)
        elif isinstance(obj, dict):
            for value in obj.values():
                collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                collect(value)

    collect(state)
    return copy.deepcopy(state, memo)


class BackgroundWriter:
    """Runs one write at a time in a thread of its own; ``wait`` joins it and raises its error.

    The thread is not a daemon: an interpreter that exits with a write in flight finishes it first
    (a hard exit, ``os._exit``, or a kill does not: the atomic write then leaves the previous
    checkpoint in place and a temporary that the next pruning removes).
    """

    def __init__(self, name: str = "checkpoint-writer"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """True while a write runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], object]) -> None:
        """Start ``write`` in the background once the write in flight is done (its error raised here)."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name=self.name)
        self._thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            # Training first where the two share a core: this thread (a task of its own on Linux) at
            # a lower priority. Raising one's niceness needs no privilege; elsewhere it stays as it was.
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
            write()
        except BaseException as e:  # handed to the waiting thread, which raises it
            self._error = e

    def wait(self) -> None:
        """Return once no write is in flight; raise the error of the write that just ended, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
