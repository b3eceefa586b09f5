"""TEST.TTA flip: evaluation scores the mean of the logits of each image and of its horizontal flip.

Checked against the same mean written out here over the digits' val split (the model called on each
image and on its flip, the loss and hits counted by hand), on one rank and on two.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EVAL_TINY, on_ranks

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.models import build_model
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.evaluation import validate
from distribuuuu.training.inputs import build_val_split


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return build_model("tiny_cnn", 10).eval()


def _by_hand(model: torch.nn.Module, cfg) -> dict:
    """Loss sum, top-1 hits and samples of the flip-averaged logits, one batch at a time."""
    loss_sum, hits, samples = 0.0, 0, 0
    with torch.no_grad():
        for images, targets, _ in build_val_split(cfg, DistEnv()).loader:
            logits = (model(images) + model(torch.flip(images, dims=[3]))) / 2
            loss_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            hits += int((logits.argmax(1) == targets).sum())
            samples += len(targets)
    return {"loss": loss_sum / samples, "top1": hits, "samples": samples}


def test_flip_tta_scores_the_mean_of_the_image_and_its_flip_logits():
    cfg = load_cfg(None, [*EVAL_TINY, "TEST.TTA", "flip", "TEST.BATCH_SIZE", "50"])
    model = _model()
    expected = _by_hand(model, cfg)
    totals = validate(model, build_val_split(cfg, DistEnv()), cfg, DistEnv())
    assert (totals["top1"], totals["samples"]) == (expected["top1"], expected["samples"]) == (expected["top1"], 361)
    # The loss: per-batch means summed in float64 against float32 batch sums here: a few ulps of the mean.
    assert totals["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    plain = validate(model, build_val_split(cfg, DistEnv()), load_cfg(None, EVAL_TINY), DistEnv())
    assert plain["loss"] != totals["loss"]  # the digits are not symmetric: the flip changes the logits


def test_flip_tta_is_exact_across_ranks():
    cfg = load_cfg(None, [*EVAL_TINY, "TEST.TTA", "flip", "TEST.BATCH_SIZE", "50"])
    model = _model()
    one = validate(model, build_val_split(cfg, DistEnv()), cfg, DistEnv())

    def rank(r: int) -> dict:
        env = DistEnv(rank=r, world_size=2, launcher="torchrun")
        return validate(model, build_val_split(cfg, env), cfg, env)

    for totals in on_ranks(2, rank):
        assert (totals["top1"], totals["samples"]) == (one["top1"], one["samples"])
        # Other batches on two ranks: each batch's mean loss is float32 (2**-24 relative, a few ulps over its sum).
        assert totals["loss"] == pytest.approx(one["loss"], rel=1e-6)


def test_an_unknown_tta_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^TEST.TTA must be one of \('', 'flip'\), got 'crops'"):
        load_cfg(None, ["TEST.TTA", "crops"])
