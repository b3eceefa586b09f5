"""Multi-label metrics exact across ranks: mAP from per-class score counts, F1, precision and recall
at a threshold from per-class outcome counts (MODEL.TASK multilabel).

Average precision ranks every sample's score. Gathering each sample's (score, target) pairs would
take N x C values (4 GB for 1M images x 1,000 classes in fp32, and as much again on the rank that
sorts them). Instead each rank counts, per class, its samples and its positives at each of
``bins`` levels of the logit (uniform over [-16, 16], clamped there): integers, summed by one
all-reduce, so 1, 2 or 3 ranks hold the same totals to the last count and compute the same AP to
the last digit. That AP is scikit-learn's ``average_precision_score`` of the quantised scores:
scores in one level are tied, as equal scores are for scikit-learn. The counts take
``2 x C x bins`` int64s on each rank whatever N: 65.5 MB for 1,000 classes at TEST.AP_BINS 4096
(1/128 of a logit per level). F1, precision and recall need no quantisation: true positives, false
positives and false negatives per class at TEST.THRESHOLD, counted from the scores themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from distribuuuu.runtime.process_group import all_reduce_sum

LOGIT_RANGE = 16.0  # logits beyond +-16 (scores within 1.2e-7 of 0 or 1) share the end levels
FIELDS = ("map", "f1_macro", "f1_micro", "precision_macro", "precision_micro", "recall_macro", "recall_micro")


def score_levels(logits: torch.Tensor, bins: int) -> torch.Tensor:
    """Each logit's quantisation level in 0..bins-1 (uniform over [-LOGIT_RANGE, LOGIT_RANGE])."""
    scaled = (logits.float().clamp(-LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) * (bins / (2 * LOGIT_RANGE))
    return scaled.floor().long().clamp_(max=bins - 1)


def predicted(logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which classes are predicted: sigmoid score at least ``threshold``."""
    return torch.sigmoid(logits.float()) >= threshold


class MultiLabelSums:
    """Per-class counts of an evaluation, on the device: samples and positives at each score level,
    and true positives, false positives, false negatives at the threshold. No host sync per batch."""

    def __init__(self, num_classes: int, bins: int, threshold: float, device: torch.device):
        self.bins, self.threshold = bins, threshold
        self.levels = torch.zeros(2, num_classes * bins, dtype=torch.int64, device=device)  # samples, positives
        self.outcomes = torch.zeros(3, num_classes, dtype=torch.int64, device=device)  # TP, FP, FN
        self.offsets = torch.arange(num_classes, device=device) * bins

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Count a batch: ``logits`` (N, C), ``targets`` multi-hot (N, C)."""
        positive = targets > 0.5
        cells = (score_levels(logits, self.bins) + self.offsets).flatten()
        # index_add_ of integer ones: exact in any order, and no host sync (bincount would read min/max)
        self.levels[0].index_add_(0, cells, torch.ones_like(cells))
        hits = cells[positive.flatten()]
        self.levels[1].index_add_(0, hits, torch.ones_like(hits))
        pred = predicted(logits, self.threshold)
        self.outcomes += torch.stack([(pred & positive).sum(0), (pred & ~positive).sum(0), (~pred & positive).sum(0)])

    def reduce(self) -> dict[str, float]:
        """Sum the counts over ranks (a collective: every rank calls it); return the metrics, in percent."""
        levels = all_reduce_sum(self.levels.clone()).cpu().numpy().reshape(2, -1, self.bins)
        outcomes = all_reduce_sum(self.outcomes.clone()).cpu().numpy()
        return metrics_from_counts(levels, outcomes)


def average_precisions(levels: np.ndarray) -> np.ndarray:
    """Each class's average precision from its (samples, positives) counts per score level, NaN for
    a class without positives: sum over levels, highest first, of the level's share of the
    positives times the precision of the levels down to it (a level's samples are tied)."""
    samples, positives = levels[0][:, ::-1].astype(np.float64), levels[1][:, ::-1].astype(np.float64)
    precision = np.cumsum(positives, axis=1) / np.maximum(np.cumsum(samples, axis=1), 1.0)
    total = positives.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (positives * precision).sum(axis=1) / total, np.nan)


def metrics_from_counts(levels: np.ndarray, outcomes: np.ndarray) -> dict[str, float]:
    """mAP over the classes with positives; F1, precision and recall, macro (the mean over classes,
    0 for a class where one is undefined, scikit-learn's zero_division=0) and micro (of the summed
    counts); all in percent."""
    ap = average_precisions(levels)
    tp, fp, fn = outcomes.astype(np.float64)

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.divide(num, den, out=np.zeros_like(num), where=den > 0)

    def micro(num: float, den: float) -> float:
        return 100.0 * num / den if den > 0 else 0.0

    return {
        "map": 100.0 * float(np.nanmean(ap)) if np.isfinite(ap).any() else 0.0,
        "f1_macro": 100.0 * float(ratio(2 * tp, 2 * tp + fp + fn).mean()),
        "f1_micro": micro(2 * tp.sum(), 2 * tp.sum() + fp.sum() + fn.sum()),
        "precision_macro": 100.0 * float(ratio(tp, tp + fp).mean()),
        "precision_micro": micro(tp.sum(), tp.sum() + fp.sum()),
        "recall_macro": 100.0 * float(ratio(tp, tp + fn).mean()),
        "recall_micro": micro(tp.sum(), tp.sum() + fn.sum()),
    }
