"""Shared fixtures; the repository is importable when the tests run from a checkout without ``pip install -e``."""

import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The suite's shared modules (helpers, models, processes, runs, *_helpers) import by name from test files in
# any folder under tests/ (unit/<subpackage>/, integration/): tests/ itself on the path, not each file's folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# A process the tests start that dies of a fatal signal (a C++ abort in a collective library, say)
# prints every thread's Python stack: what a rare failure in CI leaves to read.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# A suite started in the background (`pytest &`, `nohup`) inherits SIGINT ignored, as would each process
# it launches (the trainer keeps an ignored SIGINT ignored: the Ctrl-C tests fail). Handled, exec resets it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import models  # noqa: E402, F401  (registers the suite's tiny models for in-process tool runs)
from processes import pytest_configure, pytest_sessionfinish  # noqa: E402, F401  (hooks: tag, then reap)

pytest_plugins = ["runs"]  # the shared training runs (tests/runs.py)


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
        req = Requirement(line) if line.startswith(("torch", "torchvision")) else None
        if req and not req.specifier.contains(Version(version(req.name)).base_version):
            return f"{req.name} {version(req.name)} is below the floor requirements.txt sets ({req})"
    return ""


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
    """A plain distribuuuu logger for the test (in-process runs point it at captured streams), put back after."""
    log = logging.getLogger("distribuuuu")
    saved = (log.handlers[:], log.level, log.propagate)
    log.handlers, log.level, log.propagate = [], logging.NOTSET, True
    yield
    for handler in log.handlers:
        handler.close()
    log.handlers, log.level, log.propagate = saved


def pytest_terminal_summary(terminalreporter):
    """The versions and the CPU a run's results come from, at the end of every run (``-q`` too)."""
    import platform

    import torch
    import torchvision

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    terminalreporter.write_line(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}, CPU: {cpu}"
    )
