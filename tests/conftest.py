"""Shared fixtures; the repository is importable when the tests run from a checkout without ``pip install -e``."""

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# A process the tests start that dies of a fatal signal (a C++ abort in a collective library, say)
# prints every thread's Python stack: what a rare failure in CI leaves to read.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# A suite started in the background (`pytest &` in a script, `nohup`) inherits SIGINT ignored, and so
# would every process it launches: the trainer rightly keeps an ignored SIGINT ignored, and the Ctrl-C
# tests fail. Handled here, it is the default again in each process the tests start (exec resets it).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import background  # noqa: E402
import processes  # noqa: E402
import zygote  # noqa: E402
from processes import pytest_configure  # noqa: E402, F401  (a hook: tags the session's processes)


def pytest_sessionstart(session):
    """Refuse, in one line and before any test, a torch or torchvision below requirements.txt's floor."""
    below = _below_floor()
    if below:
        pytest.exit(f"{below}: install a supported release (docs/development.md, 'Another torch')", returncode=4)


def _below_floor() -> str:
    """'torch X is below the floor requirements.txt sets (torch>=Y)' for the first such package, or ''."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    for line in (Path(__file__).resolve().parents[1] / "requirements.txt").read_text().splitlines():
        if line.startswith(("torch", "torchvision")):
            req = Requirement(line)
            installed = version(req.name)
            if Version(installed).release and not req.specifier.contains(Version(installed).base_version):
                return f"{req.name} {installed} is below the floor requirements.txt sets ({req})"
    return ""


def pytest_sessionfinish(session, exitstatus):
    """No process outlives the tests: the zygote server ends (killing what it forked and still
    runs), then anything else the tests started and left fails the session (tests/processes.py)."""
    global _zygote_account
    _zygote_account = zygote.stop()
    processes.pytest_sessionfinish(session, exitstatus)


_zygote_account = ""


@pytest.fixture
def own_signal_handlers() -> Iterator[None]:
    """Put back this process's SIGINT/SIGTERM/SIGUSR1 handlers, which a stopped PreemptionHandler keeps."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


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
# Background jobs (tests/background.py): they run one after another from the session's start, the
# accuracy run last. Beside them run the tests that leave a core idle (marked ``one_core``), then the
# rest; the jobs' readers run last.
# ------------------------------------------------------------------------------------------------
# A background job's rank may wait long for its peer while the foreground holds the CPU.
PATIENT = ["DIST.TIMEOUT_S", "3600", "DIST.INIT_CHECK_TIMEOUT_S", "3600"]


def _reads_a_job(item) -> bool:
    return not background.JOBS.keys().isdisjoint(item.fixturenames)


def pytest_collection_modifyitems(items):
    """The one-core tests first, then the rest and the jobs' readers, in their order within each group."""
    items.sort(key=lambda item: 2 if _reads_a_job(item) else 0 if item.get_closest_marker("one_core") else 1)


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request, tmp_path_factory):
    """The background jobs that the selected tests read (none in the quick tier), started at once."""
    needed = {name for item in request.session.items for name in item.fixturenames} & background.JOBS.keys()
    with contextlib.ExitStack() as stack:
        jobs = background.Jobs(needed, tmp_path_factory, stack)
        jobs.start()
        yield jobs
        jobs.close()


@background.background_job(last=True)
def digits_run(tmp_path_factory, stack):
    """config/digits_recipe.yaml (resnet18, 12 epochs, ddp) under torchrun with 2 processes,
    reading a packed copy of data/digits (made by tools/pack_dataset.py) from a real HTTP server
    on 127.0.0.1, up for the session.

    One run serves every test that needs a well-trained digits model: the accuracy test checks
    it, the fine-tuning test starts from its ``best.pth.tar``. ddp, not fsdp: an fsdp epoch took
    17 s against ddp's 12 s here (gloo all-gathers and reduce-scatters every block), and fsdp
    trains ddp's weights (tests/test_fsdp.py, tests/test_resume_world_size.py). Returns (OUT_DIR,
    the finished process, the data keys).
    """
    from helpers import REPO, TRAIN, assert_ok, python, run, serve_folder, torchrun

    root = tmp_path_factory.mktemp("digits_recipe_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(run(python(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed))))
    url = stack.enter_context(serve_folder(packed))
    data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
    recipe = ["--cfg", str(REPO / "config" / "digits_recipe.yaml")]
    return out, run(torchrun(2, TRAIN, *recipe, "OUT_DIR", str(out), *data, *PATIENT), timeout=background.WAIT_S), data


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
