"""Activation checkpointing in real training: under DDP and FSDP on 2 ranks (a launch), and a run resumed
with it on ending with the weights of the run without. The runs of tests/unit/models/test_model_options.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, TRAIN, assert_ok, clean_env, in_process, run_torchrun


@pytest.mark.slow
def test_checkpointing_under_ddp_and_fsdp_trains_the_weights_of_the_unchecked_run(tmp_path):
    """2 ranks, a ResNet (BatchNorm) and a ViT, full and every-2nd-block checkpointing, each against the
    same strategy unchecked: the recomputation is the same arithmetic (the weights and statistics of
    fp32 CPU kernels run twice on the same inputs: equal), with FSDP2's gathers redone for it."""
    out = tmp_path / "checkpointing.json"
    job = str(REPO / "tests" / "scripts" / "checkpointing_job.py")
    assert_ok(run_torchrun(2, job, str(out), timeout=300, env=clean_env()))
    results = json.loads(out.read_text())
    assert len(results) == 8  # 2 models x (ddp, fsdp) x (full, selective)
    for name, diff in results.items():
        assert diff == {"weights": 0.0, "buffers": 0.0}, name


@pytest.mark.slow
def test_a_run_resumed_with_checkpointing_on_ends_with_the_weights_of_the_run_without(tmp_path):
    """MODEL.ACTIVATION_CHECKPOINTING changes memory and time, not what is trained: a run stopped after
    one epoch and resumed with full checkpointing (a runtime key: no other experiment) ends where the
    uninterrupted run without it ends, bit for bit."""
    from distribuuuu.checkpointing.checkpoint import load_checkpoint

    opts = ["MODEL.ARCH", "shufflenet_v2_x0_5", "TRAIN.SPLIT", "val", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]
    opts += ["OPTIM.MAX_EPOCH", "2", "LOG.PLOT", "False", "TRAIN.CKPT_ASYNC", "False"]
    assert_ok(in_process(TRAIN, "OUT_DIR", str(tmp_path / "plain"), *opts))
    resumed = ["OUT_DIR", str(tmp_path / "resumed"), *opts]
    assert_ok(in_process(TRAIN, *resumed, "TRAIN.STOP_AFTER_EPOCHS", "1"))
    result = in_process(TRAIN, *resumed, "MODEL.ACTIVATION_CHECKPOINTING", "full")
    assert_ok(result)
    assert "16 of the 16 blocks recomputed in backward" in result.stdout + result.stderr
    final = [
        load_checkpoint(str(tmp_path / run / "checkpoints" / "ckpt_ep_002.pth.tar")) for run in ("plain", "resumed")
    ]
    for name, tensor in final[0]["model"].items():
        assert torch.equal(final[1]["model"][name], tensor), name
