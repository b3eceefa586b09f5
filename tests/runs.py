"""The training runs many tests read, each made once a session, when a test first asks for it.

A run's fixture returns where it wrote (and what its tests need to know of it); tests only read.
"""

from __future__ import annotations

import contextlib

import pytest
from helpers import REPO, TRAIN, assert_ok, in_process, run_torchrun, serve_folder


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """config/digits_recipe.yaml (resnet18, 12 epochs, ddp) under torchrun with 2 processes,
    reading a packed copy of data/digits (made by tools/pack_dataset.py) from a real HTTP server
    on 127.0.0.1, up for the session.

    One run serves every test that needs a well-trained digits model: the accuracy test checks
    it, the fine-tuning test starts from its ``best.pth.tar``. ddp, not fsdp: an fsdp epoch took
    17 s against ddp's 12 s here (gloo all-gathers and reduce-scatters every block), and fsdp
    trains ddp's weights (tests/test_fsdp.py, tests/test_resume_world_size.py). Returns (OUT_DIR,
    the finished process, the data keys).
    """
    root = tmp_path_factory.mktemp("digits_recipe_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(in_process(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed)))
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serve_folder(packed))
        data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
        recipe = ["--cfg", str(REPO / "config" / "digits_recipe.yaml")]
        yield out, run_torchrun(2, TRAIN, *recipe, "OUT_DIR", str(out), *data, timeout=1200), data
