"""Training losses against sums written out by hand (and against timm's BCE where installed)."""

from __future__ import annotations

import math

import pytest
import torch

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data.samplers import inverse_frequency_weights
from distribuuuu.losses import LOSSES, BinaryCrossEntropy
from distribuuuu.training.task import MultiClass

LOGITS = torch.tensor([[2.0, -1.0, 0.5], [0.0, 1.5, -2.0]])


def build_criterion(loss: str, label_smoothing: float = 0.0, bce_target_threshold=None, class_weights=None):
    """A multi-class task's TRAIN.LOSS for LOGITS' 3 classes, as training builds it."""
    weights = None if class_weights is None else torch.tensor(class_weights)
    return MultiClass(3).criterion(loss, label_smoothing, bce_target_threshold, weights)


def _bce_by_hand(logits, targets, weights=(1.0, 1.0, 1.0)) -> float:
    """Mean over samples and classes of -w_c [t log s(x) + (1 - t) log(1 - s(x))]."""
    terms = []
    for row, trow in zip(logits.tolist(), targets):
        for c, (x, t) in enumerate(zip(row, trow)):
            s = 1 / (1 + math.exp(-x))
            terms.append(-weights[c] * (t * math.log(s) + (1 - t) * math.log(1 - s)))
    return sum(terms) / len(terms)


def test_bce_smooths_hard_labels_as_timm_does():
    loss = build_criterion("bce", label_smoothing=0.3)(LOGITS, torch.tensor([0, 1]))
    off, on = 0.1, 0.8  # smoothing / C, and 1 - smoothing + smoothing / C
    assert loss.item() == pytest.approx(_bce_by_hand(LOGITS, [[on, off, off], [off, on, off]]), rel=1e-6)


def test_bce_target_threshold_binarises_soft_targets():
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.15, 0.85, 0.0]])  # a mixup of two labels
    loss = build_criterion("bce", bce_target_threshold=0.2)(LOGITS, soft)
    assert loss.item() == pytest.approx(_bce_by_hand(LOGITS, [[1, 1, 0], [0, 1, 0]]), rel=1e-6)
    unthresholded = build_criterion("bce")(LOGITS, soft)
    assert unthresholded.item() == pytest.approx(_bce_by_hand(LOGITS, soft.tolist()), rel=1e-6)


def test_bce_class_weights_scale_each_class_column():
    loss = build_criterion("bce", class_weights=[1.0, 3.0, 0.5])(LOGITS, torch.tensor([2, 0]))
    expected = _bce_by_hand(LOGITS, [[0, 0, 1], [1, 0, 0]], weights=(1.0, 3.0, 0.5))
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_bce_matches_timms():
    timm_loss = pytest.importorskip("timm.loss")
    target = torch.tensor([1, 2])
    ours = BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2)(LOGITS, target)
    theirs = timm_loss.BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2)(LOGITS, target)
    assert torch.allclose(ours, theirs)


def test_class_weighted_cross_entropy_is_the_weighted_mean_of_negative_log_likelihoods():
    weights, target = [0.5, 2.0, 1.0], [0, 1]
    loss = build_criterion("ce", class_weights=weights)(LOGITS, torch.tensor(target))
    nll = [math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(LOGITS.tolist(), target)]
    expected = sum(weights[t] * n for t, n in zip(target, nll)) / sum(weights[t] for t in target)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_keeps_label_smoothing():
    loss = build_criterion("ce", label_smoothing=0.3)(LOGITS, torch.tensor([0, 1]))
    logp = torch.log_softmax(LOGITS.double(), dim=1)
    target = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]], dtype=torch.float64)
    assert loss.item() == pytest.approx(-(target * logp).sum(1).mean().item(), rel=1e-6)


def test_the_config_takes_the_loss_registrys_names_and_refuses_others(monkeypatch):
    assert load_cfg(None, ["TRAIN.LOSS", "bce"]).TRAIN.LOSS == "bce"
    with pytest.raises(ConfigError, match=r"TRAIN.LOSS must be one of \('ce', 'bce'\), got 'focal'"):
        load_cfg(None, ["TRAIN.LOSS", "focal"])
    monkeypatch.setitem(LOSSES, "focal", BinaryCrossEntropy)  # a loss registered is a loss the config takes
    assert load_cfg(None, ["TRAIN.LOSS", "focal"]).TRAIN.LOSS == "focal"


def test_inverse_frequency_weights_are_balanced_and_reject_empty_classes():
    weights = inverse_frequency_weights([0, 0, 0, 1, 2, 2], 3)
    assert weights.tolist() == pytest.approx([6 / 9, 6 / 3, 6 / 6])
    # Each class then carries the same total weight: count x weight = N / C.
    assert (torch.bincount(torch.tensor([0, 0, 0, 1, 2, 2])) * weights).tolist() == pytest.approx([2.0] * 3)
    with pytest.raises(ValueError, match=r"classes \[1\] have no samples"):
        inverse_frequency_weights([0, 2], 3)
