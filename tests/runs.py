"""The training runs many tests read, each made once a session, when a test first asks for it.

A run's fixture returns where it wrote (and what its tests need to know of it); tests only read (a
test that writes copies the OUT_DIR first; one that runs the trainer into it asserts nothing changed).
"""

from __future__ import annotations

import pytest
from helpers import EVAL_TINY, REPO, TINY_TRAIN, TRAIN, assert_ok, in_process, lone_env, run_torchrun, serve_folder

# The single-process run: the tiny CNN with EMA at a high LR (each epoch's weights, and the EMA's,
# differ), input keys away from the defaults a tool must take from its checkpoint (top-1 57-75%, 4 seeds);
# every epoch's checkpoint kept (the default keeps the newest), which averaging and evaluation read.
EMA_EPOCHS = 3
EMA_RUN_OPTS = [
    *EVAL_TINY, "TRAIN.IM_SIZE", "24", "TEST.IM_SIZE", "28", "DATA.MEAN", "[0.5, 0.5, 0.5]", "DATA.STD", "[0.5, 0.5, 0.5]",
    "OPTIM.MAX_EPOCH", str(EMA_EPOCHS), "OPTIM.BASE_LR", "0.4", "OPTIM.EMA_DECAY", "0.5", "TRAIN.PRINT_FREQ", "10",
    "TRAIN.KEEP_CKPTS", str(EMA_EPOCHS),
]  # fmt: skip


@pytest.fixture(scope="session")
def ema_run(tmp_path_factory):
    """EMA_RUN_OPTS on data/digits, train_net.py's entry point in this process: its OUT_DIR (single-file
    checkpoints). Read by the predict, avg_checkpoints, finished-run and one-experiment tests."""
    out = tmp_path_factory.mktemp("ema_run") / "out"
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *EMA_RUN_OPTS, env=lone_env()))
    return out


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """config/digits_recipe.yaml (12 epochs, ddp: faster, and fsdp trains its weights) under torchrun, 2
    processes, reading packed digits (the data extra) from an HTTP server on 127.0.0.1, up for the session:
    read by the accuracy and fine-tuning tests. Returns (OUT_DIR, the finished process, the data keys)."""
    pytest.importorskip("webdataset")
    pytest.importorskip("wids")
    root = tmp_path_factory.mktemp("digits_recipe_packed")
    packed, out = root / "packed", root / "out"
    assert_ok(in_process(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed)))
    with serve_folder(packed) as url:
        data = ["TRAIN.DATASET", url, "TEST.DATASET", url, "DATA.SHARD_CACHE", str(root / "cache")]
        recipe = ["--cfg", str(REPO / "config" / "digits_recipe.yaml")]
        yield out, run_torchrun(2, TRAIN, *recipe, "OUT_DIR", str(out), *data, timeout=1200), data
