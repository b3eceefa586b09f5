"""Shared fixtures; the repository is importable when the tests run from a checkout without ``pip install -e``."""

import contextlib
import functools
import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# A process the tests start that dies of a fatal signal (a C++ abort in a collective library, say)
# prints every thread's Python stack: what a rare failure in CI leaves to read.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import processes  # noqa: E402
import zygote  # noqa: E402
from processes import pytest_configure  # noqa: E402, F401  (a hook: tags the session's processes)


def pytest_sessionfinish(session, exitstatus):
    """No process outlives the tests: the zygote server ends (killing what it forked and still
    runs), then anything else the tests started and left fails the session (tests/processes.py)."""
    global _zygote_account
    _zygote_account = zygote.stop()
    processes.pytest_sessionfinish(session, exitstatus)


_zygote_account = ""


@pytest.fixture
def plain_logging():
    """In-process runs (cli.run_tool) point the distribuuuu logger at pytest's captured streams and
    stop its propagation: give a test a plain logger, and restore the previous one afterwards."""
    log = logging.getLogger("distribuuuu")
    saved = (log.handlers[:], log.level, log.propagate)
    log.handlers, log.propagate = [], True
    log.setLevel(logging.NOTSET)
    yield
    for handler in log.handlers:
        handler.close()
    log.handlers, log.propagate = saved[0], saved[2]
    log.setLevel(saved[1])


# ------------------------------------------------------------------------------------------------
# The accuracy runs (ACCURACY_RUN_STARTS; one today, digits_run): the tests that read them run last;
# the runs start together at normal priority when the first test that mostly waits (marked
# "waits": the fault tests, which sit out timeouts and restarts with the cores half idle) begins,
# so that they fill those idle cores; or when the
# first test that needs a run begins, if no waiting test was selected (DISTRIBUUUU_TEST_ACCURACY_RUNS
# =last, the default); or with the session at idle CPU priority (=background). Measured on a 2-vCPU
# AMD EPYC, full suite: "last" (then without the overlap) 30 min 27 s, "background" 31 min 56 s; the
# background runs slowed the foreground tests 2-3x while they ran (docs/development.md).
# ------------------------------------------------------------------------------------------------
# A background job's rank may wait long for its peer while the foreground holds the CPU.
PATIENT = ["DIST.TIMEOUT_S", "3600", "DIST.INIT_CHECK_TIMEOUT_S", "3600"]
WAIT_S = 1200  # once a test waits for the run (about 200 s alone on the AMD machine)
ACCURACY_RUNS = os.environ.get("DISTRIBUUUU_TEST_ACCURACY_RUNS", "last")


@contextlib.contextmanager
def _digits_run(tmp_path_factory, idle: bool):
    from helpers import REPO, TRAIN, assert_ok, background, python, run, serve_folder, torchrun

    root = tmp_path_factory.mktemp("digits_recipe_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(run(python(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed))))
    with serve_folder(packed) as url:
        data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
        recipe = ["--cfg", str(REPO / "config" / "digits_recipe.yaml")]
        job = background(torchrun(2, TRAIN, *recipe, "OUT_DIR", str(out), *data, *PATIENT), idle=idle)
        try:
            yield lambda: (out, job.result(WAIT_S), data)
        finally:
            job.close()


ACCURACY_RUN_STARTS = {"digits_run": _digits_run}


def _waits(item) -> bool:
    return item.get_closest_marker("waits") is not None


def _reads_a_run(item) -> bool:
    return not ACCURACY_RUN_STARTS.keys().isdisjoint(item.fixturenames)


def pytest_collection_modifyitems(items):
    """The tests of the accuracy runs go last (in their order), just after the waiting tests: the
    runs start when the first waiting test does, else when the first test needs one."""
    items.sort(key=lambda item: 2 if _reads_a_run(item) else 1 if _waits(item) else 0)


class AccuracyRuns(dict):
    """{name: a function that waits for the run and returns what it made}; ``start()`` starts every
    run the session needs (once) without waiting."""

    def __init__(self, waits: dict, start=lambda: None):
        super().__init__(waits)
        self.start = start


@pytest.fixture(scope="session", autouse=True)
def accuracy_runs(request, tmp_path_factory):
    """Each accuracy run that a selected test needs (none in the quick tier), started as
    ``ACCURACY_RUNS`` says."""
    needed = sorted({name for item in request.session.items for name in item.fixturenames} & ACCURACY_RUN_STARTS.keys())
    with contextlib.ExitStack() as stack:
        if ACCURACY_RUNS == "background":
            yield AccuracyRuns(
                {name: stack.enter_context(ACCURACY_RUN_STARTS[name](tmp_path_factory, idle=True)) for name in needed}
            )
            return
        started = {}  # "last": all of them at once, at normal priority

        def start():
            if not started:
                started.update(
                    {n: stack.enter_context(ACCURACY_RUN_STARTS[n](tmp_path_factory, idle=False)) for n in needed}
                )

        def wait(name):
            start()
            return started[name]()

        yield AccuracyRuns({name: functools.partial(wait, name) for name in needed}, start)


@pytest.fixture(autouse=True)
def _accuracy_runs_beside_waiting_tests(request, accuracy_runs):
    """A test marked "waits" starts the accuracy runs, to run beside it on the cores it leaves idle."""
    if _waits(request.node):
        accuracy_runs.start()


@pytest.fixture(scope="session")
def digits_run(accuracy_runs):
    """config/digits_recipe.yaml (resnet18, 12 epochs, ddp) under torchrun with 2 processes,
    reading a packed copy of data/digits (made by tools/pack_dataset.py) from a real HTTP server
    on 127.0.0.1, up for the session.

    One run serves every test that needs a well-trained digits model: the accuracy test checks
    it, the fine-tuning test starts from its ``best.pth.tar``. ddp, not fsdp: an fsdp epoch took
    17 s against ddp's 12 s here (gloo all-gathers and reduce-scatters every block), and fsdp
    trains ddp's weights (tests/test_fsdp.py, tests/test_resume_world_size.py). Returns (OUT_DIR,
    the finished process, the data keys).
    """
    return accuracy_runs["digits_run"]()


def pytest_terminal_summary(terminalreporter):
    """The versions and the CPU a run's results come from, at the end of every run (``-q`` too)."""
    if _zygote_account:  # how many launches were forked, and which were started fresh, and why
        terminalreporter.write_line("zygote: " + _zygote_account.strip().replace("\n", "\nzygote: "))
    terminalreporter.write_line(_versions())


def _versions() -> str:
    import platform

    import torch
    import torchvision

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    return f"torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}, CPU: {cpu}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
