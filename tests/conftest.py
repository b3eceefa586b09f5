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
    from helpers import REPO, TRAIN, assert_ok, python, run, serve_folder, torchrun

    root = tmp_path_factory.mktemp("digits_fsdp_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(run(python(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed))))
    with serve_folder(packed) as url:
        data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
        yield out, run(torchrun(2, TRAIN, "OUT_DIR", str(out), "DIST.STRATEGY", "fsdp", *data), timeout=900), data
