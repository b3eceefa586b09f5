"""Background jobs: long multi-process runs that the session starts early and its tests only read.

A job is a function of the session's ``tmp_path_factory`` and an ``ExitStack`` that stays open
until the session ends (for what must outlive the job, an HTTP server its readers use), registered
with ``@background_job(beside=MARKER)``; the decorator returns a session fixture of the job's name
that waits for the job's result (raising its error). Each job starts when the first test marked
``MARKER`` begins, beside the tests that leave a core idle:

- ``waits``: the fault tests, which sit out timeouts, restarts and signals;
- ``hosts``: the in-process files (tools run in the test process, one thread: one core of two).

The jobs of one marker run one after another in a thread of this process (a job's launches are
processes; the thread only waits for them), so that a host has one job beside it, not all of them
at once. A test that needs a job whose marker no selected test carries starts it itself.
``tests/conftest.py`` orders the session: the hosts first, the waiting tests and the jobs' readers last.

Measured on a 2-vCPU AMD EPYC (docs/development.md): a 2-process job beside a single-threaded file
fills the idle core (the tool matrix and the recipe run: 238 s together against 312 s one after
the other); at idle CPU priority instead (``SCHED_IDLE``, a job for the whole session) the
foreground ran 2-3x slower and the suite took longer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Callable

import pytest
import zygote
from helpers import environment_of_this_thread

WAIT_S = 1200  # the longest a reader waits for its job (the accuracy run: about 200 s alone here)


@dataclasses.dataclass
class Job:
    make: Callable[[pytest.TempPathFactory, contextlib.ExitStack], Any]
    beside: str


JOBS: dict[str, Job] = {}


def background_job(beside: str) -> Callable:
    """Register ``make(tmp_path_factory, stack)`` as a job started beside the tests marked ``beside``;
    return a session fixture, named as the function, that waits for what it returns."""

    def wrap(make: Callable) -> Callable:
        JOBS[make.__name__] = Job(make, beside)

        @pytest.fixture(scope="session", name=make.__name__)
        def wait_for_job(background_jobs: Jobs) -> Any:
            return background_jobs.result(make.__name__)

        wait_for_job.__doc__ = make.__doc__
        return wait_for_job

    return wrap


class Jobs:
    """The session's needed jobs: ``start_beside(marker)`` starts that marker's (once),
    ``result(name)`` waits for one."""

    def __init__(self, needed: set[str], tmp_path_factory: pytest.TempPathFactory, stack: contextlib.ExitStack):
        self._needed = [name for name in JOBS if name in needed]  # in registration (import) order
        self._factory, self._stack = tmp_path_factory, stack
        self._done = {name: threading.Event() for name in self._needed}
        self._results: dict[str, tuple[bool, Any]] = {}
        self._started: set[str] = set()
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def start_beside(self, marker: str) -> None:
        with self._lock:
            if marker in self._started:
                return
            self._started.add(marker)
        names = [name for name in self._needed if JOBS[name].beside == marker]
        if names:
            zygote.address()  # the fork server, if not up yet, starts with this (main) thread's environment
            # The environment now, in the main thread: an in-process tool run swaps os.environ while it runs.
            args = (names, dict(os.environ))
            threading.Thread(target=self._run, args=args, name=f"jobs beside {marker}", daemon=True).start()

    def result(self, name: str) -> Any:
        self.start_beside(JOBS[name].beside)
        if not self._done[name].wait(WAIT_S):
            raise AssertionError(f"the background job {name} did not finish in {WAIT_S}s")
        ok, value = self._results[name]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """The session ends: start no further job (conftest's session end kills what still runs)."""
        self._closing.set()

    def _run(self, names: list[str], environ: dict[str, str]) -> None:
        with environment_of_this_thread(environ):
            for name in names:
                try:
                    if self._closing.is_set():
                        raise AssertionError(f"the background job {name} did not start: the session ended")
                    self._results[name] = (True, JOBS[name].make(self._factory, self._stack))
                except BaseException as e:  # the reader's test fails with it
                    self._results[name] = (False, e)
                self._done[name].set()
