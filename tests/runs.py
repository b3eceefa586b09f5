"""The training runs many tests read, each made once a session, when a test first asks for it.

A run's fixture returns where it wrote (and what its tests need to know of it); tests only read.
"""

from __future__ import annotations

import contextlib

import pytest
from helpers import EVAL_TINY, REPO, TINY_TRAIN, TRAIN, assert_ok, in_process, lone_env, run_torchrun, serve_folder

EMA_EPOCHS = 3
# The shared single-process run: the tiny CNN on data/digits with EMA, at a high LR so that each
# epoch's weights (and the EMA's) differ, and with input keys away from the defaults (train 24 px,
# eval 28 px, mean and std 0.5) that a tool must take from its checkpoint or miss by far. 74.8% top-1
# after 3 epochs here (single-file checkpoints; tests/test_tool_matrix.py's fsdp run writes .dcp).
EMA_RUN_OPTS = [
    *EVAL_TINY, "TRAIN.IM_SIZE", "24", "TEST.IM_SIZE", "28", "DATA.MEAN", "[0.5, 0.5, 0.5]", "DATA.STD", "[0.5, 0.5, 0.5]",
    "OPTIM.MAX_EPOCH", str(EMA_EPOCHS), "OPTIM.BASE_LR", "0.4", "OPTIM.EMA_DECAY", "0.5", "TRAIN.PRINT_FREQ", "10",
]  # fmt: skip


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


@pytest.fixture(scope="session")
def ema_run(tmp_path_factory):
    """EMA_RUN_OPTS trained by tools/train_net.py's entry point in this process (both cores): its
    OUT_DIR, with ``checkpoints/ckpt_ep_00{1,2,3}.pth.tar`` and ``best.pth.tar``. Read by predict.py's,
    avg_checkpoints.py's, a finished run's and the one-experiment tests; a test that writes copies it
    first (a test that runs the trainer into it asserts that nothing changed).
    """
    out = tmp_path_factory.mktemp("ema_run") / "out"
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *EMA_RUN_OPTS, env=lone_env()))
    return out
