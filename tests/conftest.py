"""Shared fixtures; the repository is importable when the tests run from a checkout without ``pip install -e``."""

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """The README's first run: the default config under torchrun with 2 processes (10 epochs).

    One run serves every test that needs a well-trained digits model: the accuracy test checks
    it, the fine-tuning test starts from its ``best.pth.tar``. Returns (OUT_DIR, the finished process).
    """
    from helpers import TRAIN, run, torchrun

    out = tmp_path_factory.mktemp("digits_default")
    return out, run(torchrun(2, TRAIN, "OUT_DIR", str(out)), timeout=900)
