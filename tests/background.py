"""Background jobs: long multi-process runs that the session starts at once and its tests only read.

A job is a function of the session's ``tmp_path_factory`` and an ``ExitStack`` that stays open
until the session ends (for what must outlive the job, an HTTP server its readers use), registered
with ``@background_job``; the decorator returns a session fixture of the job's name that waits for
the job's result (raising its error).

The session's needed jobs run one after another in one thread of this process (a job's launches
are processes; the thread only waits for them), from the session's start: one job at a time beside
the foreground tests, never several. ``tests/conftest.py`` orders the session so that the jobs
have beside them the tests that leave a core idle (marked ``one_core``: a tool on one thread, in
this process or in one process; timeouts, restarts and signals), then the rest, and the jobs'
readers last. A job fills the core such a test leaves idle; beside a test that keeps both cores
busy it only takes its share. The jobs run in registration (import) order, the accuracy run (the
longest) ``last``.

Measured on a 2-vCPU AMD EPYC (docs/development.md): a 2-process job beside a single-threaded file
fills the idle core (the tool matrix and the recipe run: 238 s together against 312 s one after
the other; the fault tests and the recipe run: 368 s against 491 s); at idle CPU priority instead
(``SCHED_IDLE``) the foreground ran 2-3x slower and the suite took longer. The accuracy run first
in the queue, beside the in-process files and then the fault tests, made the suite slower (25 min
33 s against 22 min 07 s with it last, the same machine and evening).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable

import pytest
import zygote
from helpers import environment_of_this_thread

WAIT_S = 1200  # the longest a reader waits for its job (the accuracy run: about 270 s alone here)


Make = Callable[[pytest.TempPathFactory, contextlib.ExitStack], Any]
JOBS: dict[str, Make] = {}
LAST: set[str] = set()


def background_job(make: Make | None = None, *, last: bool = False) -> Callable:
    """Register ``make(tmp_path_factory, stack)`` as a background job (``last``: after the others);
    return a session fixture, named as the function, that waits for what it returns."""
    if make is None:
        return functools.partial(background_job, last=last)
    JOBS[make.__name__] = make
    if last:
        LAST.add(make.__name__)

    @pytest.fixture(scope="session", name=make.__name__)
    def wait_for_job(background_jobs: Jobs) -> Any:
        return background_jobs.result(make.__name__)

    wait_for_job.__doc__ = make.__doc__
    return wait_for_job


class Jobs:
    """The session's needed jobs: ``start()`` starts their thread, ``result(name)`` waits for one."""

    def __init__(self, needed: set[str], tmp_path_factory: pytest.TempPathFactory, stack: contextlib.ExitStack):
        # In registration (import) order, those registered ``last`` after the others.
        self._needed = sorted((name for name in JOBS if name in needed), key=lambda name: name in LAST)
        self._factory, self._stack = tmp_path_factory, stack
        self._done = {name: threading.Event() for name in self._needed}
        self._results: dict[str, tuple[bool, Any]] = {}
        self._closing = threading.Event()

    def start(self) -> None:
        """Start the jobs' thread, if any job is needed. Call it once, from the main thread."""
        if not self._needed:
            return
        zygote.address()  # the fork server, if not up yet, starts with this (main) thread's environment
        # The environment now, in the main thread: an in-process tool run swaps os.environ while it runs.
        args = (self._needed, dict(os.environ))
        threading.Thread(target=self._run, args=args, name="background jobs", daemon=True).start()

    def result(self, name: str) -> Any:
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
                    self._results[name] = (True, JOBS[name](self._factory, self._stack))
                except BaseException as e:  # the reader's test fails with it
                    self._results[name] = (False, e)
                self._done[name].set()
