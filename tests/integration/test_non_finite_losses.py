"""Non-finite losses: TRAIN.NAN_POLICY's default stops the run naming the epoch and the first bad step;
skip skips and counts the bad steps and no NaN reaches the weights."""

from __future__ import annotations

import models
import pytest
import torch
from fault_helpers import ENV, ONE
from helpers import TINY_TRAIN, assert_ok, in_process, read_metrics

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("plain_logging")


# ------------------------------------------------------------------------------------------------
# Non-finite losses
# ------------------------------------------------------------------------------------------------
def test_nan_loss_stops_naming_epoch_and_first_bad_step(tmp_path, monkeypatch):
    bad_step = 7  # forward calls 7 and 8 (= optimizer steps 7 and 8 of epoch 1) return NaN
    monkeypatch.setattr(models, "_NAN_CALLS", {bad_step, bad_step + 1})
    result = in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path), *ONE, "OPTIM.MAX_EPOCH", "1", env=ENV)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and f"non-finite loss at epoch 1, step {bad_step}:" in errors[0]
    # It raised at the first sync point after the NaN (step 10) instead of logging it and going on.
    assert "step 5/44" in result.stdout and "step 10/44" not in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_nan_policy_skip_skips_and_counts_the_bad_steps(tmp_path, monkeypatch):
    bad = [7, 8, 20]  # forward calls = optimizer steps of epoch 1
    monkeypatch.setattr(models, "_NAN_CALLS", set(bad))
    args = ["OUT_DIR", str(tmp_path), *ONE, "OPTIM.MAX_EPOCH", "1", "TRAIN.NAN_POLICY", "skip"]
    result = in_process(TINY_TRAIN, *args, env=ENV)
    assert_ok(result)
    train = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert [r["nonfinite_steps"] for r in train] == [len(bad)]
    assert "step 10/44" in result.stdout and "non-finite steps skipped 2" in result.stdout  # window 6-10
    # One NaN gradient applied would have made every weight NaN: the steps were really skipped.
    final = load_checkpoint(str(tmp_path / "checkpoints" / ckpt.checkpoint_name(1)))
    assert all(torch.isfinite(t).all() for t in final["model"].values())
