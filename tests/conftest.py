"""Shared fixtures; the repository is importable when the tests run from a checkout without ``pip install -e``."""

import contextlib
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
# The accuracy runs: started with the session at idle CPU priority, waited for by the tests last
# ------------------------------------------------------------------------------------------------
# A background job's rank may wait long for its peer while the foreground holds the CPU.
PATIENT = ["DIST.TIMEOUT_S", "3600", "DIST.INIT_CHECK_TIMEOUT_S", "3600"]
WAIT_S = 900  # once a test waits for a run: the CPU is then its own


@contextlib.contextmanager
def _digits_run(tmp_path_factory):
    from helpers import REPO, TRAIN, assert_ok, background, python, run, serve_folder, torchrun

    root = tmp_path_factory.mktemp("digits_fsdp_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(run(python(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed))))
    with serve_folder(packed) as url:
        data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
        job = background(torchrun(2, TRAIN, "OUT_DIR", str(out), "DIST.STRATEGY", "fsdp", *data, *PATIENT))
        try:
            yield lambda: (out, job.result(WAIT_S), data)
        finally:
            job.close()


@contextlib.contextmanager
def _recipe_run(tmp_path_factory):
    from helpers import REPO, TRAIN, background, torchrun

    out = tmp_path_factory.mktemp("digits_recipe")
    job = background(
        torchrun(2, TRAIN, "--cfg", str(REPO / "config" / "digits_recipe.yaml"), "OUT_DIR", str(out), *PATIENT)
    )
    try:
        yield lambda: (out, job.result(WAIT_S))
    finally:
        job.close()


BACKGROUND_RUNS = {"digits_run": _digits_run, "recipe_run": _recipe_run}


def pytest_collection_modifyitems(items):
    """The tests of the background runs go last (in their order): their runs have had the whole
    session to finish by then."""
    items.sort(key=lambda item: not BACKGROUND_RUNS.keys().isdisjoint(item.fixturenames))


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory):
    """Start, with the session, each accuracy run that a selected test needs (none in the quick tier)."""
    needed = sorted({name for item in request.session.items for name in item.fixturenames} & BACKGROUND_RUNS.keys())
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(BACKGROUND_RUNS[name](tmp_path_factory)) for name in needed}


@pytest.fixture(scope="session")
def digits_run(background_runs):
    """The default config (10 epochs) under torchrun with 2 processes, sharded with
    ``DIST.STRATEGY fsdp``, reading a packed copy of data/digits (made by tools/pack_dataset.py)
    from a real HTTP server on 127.0.0.1, up for the session.

    One run serves every test that needs a well-trained digits model: the accuracy test checks
    it, the fine-tuning test starts from its ``best.dcp``. The README's first run (ddp on the
    ImageFolder) differs from it only in what other tests show equal: packed shards, on disk or
    over HTTP, hand over the ImageFolder's batches (test_packed_data) and fsdp trains ddp's
    weights (test_fsdp, test_resume_world_size). Returns (OUT_DIR, the finished process, the
    data keys).
    """
    return background_runs["digits_run"]()


@pytest.fixture(scope="session")
def recipe_run(background_runs):
    """config/digits_recipe.yaml (12 epochs) under torchrun with 2 processes: (OUT_DIR, the finished process)."""
    return background_runs["recipe_run"]()


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
