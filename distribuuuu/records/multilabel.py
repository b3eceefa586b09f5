"""Multi-label metrics exact across ranks: mAP from per-class score counts, F1, precision and recall
at a threshold from per-class outcome counts (MODEL.TASK multilabel).

Average precision ranks every sample's score. Gathering each sample's (score, target) pairs on one
rank would take N x C values there (200 MB for 50,000 images x 1,000 classes in fp32). Instead each
rank keeps its own share of the logits and targets until the end of the evaluation; one all-reduce
(a maximum) finds each class's lowest and highest logit over all ranks, and each rank then counts,
per class, its samples and its positives at each of ``bins`` levels spread evenly over that
class's observed range. The counts are integers, summed by one all-reduce, so 1, 2 or 3 ranks hold
the same totals to the last count and compute the same AP to the last digit. That AP is
scikit-learn's ``average_precision_score`` of the quantised scores: scores in one level (1/bins of
the class's range apart) are tied, as equal scores are for scikit-learn. Levels over the observed
range, not a fixed one, are what keep it within 0.1 point of the unquantised AP early in training,
when a class's logits span less than 0.1 (a fixed [-16, 16] put them in 5-12 levels: 6 points off).
F1, precision and recall need no quantisation: true positives, false positives and false negatives
per class at the threshold, counted from the logits themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from distribuuuu.runtime.process_group import all_reduce_max, all_reduce_sum

FIELDS = ("map", "f1_macro", "f1_micro", "precision_macro", "precision_micro", "recall_macro", "recall_micro")


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits in fp32, NaN ranked lowest and +-inf at the ends of fp32: min and max stay finite."""
    return logits.detach().float().nan_to_num(nan=-torch.finfo(torch.float32).max)


def score_levels(logits: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bins: int) -> torch.Tensor:
    """Each logit's level in 0..bins-1, uniform over its class's [``low``, ``high``] (a class whose
    logits are all equal has them all in level 0). Monotone in the logit and elementwise, so a logit
    gets the same level on any rank, in any batch."""
    low, span = low.double(), (high.double() - low.double())
    scale = torch.where(span > 0, bins / span, torch.zeros_like(span))  # float64: no overflow of span
    return (logits.double() - low).mul_(scale).floor_().long().clamp_(0, bins - 1)


def predicted(logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which classes are predicted: sigmoid score at least ``threshold``."""
    return torch.sigmoid(logits.float()) >= threshold


class MultiLabelSums:
    """An evaluation's multi-label figures: this rank's logits and targets, kept on the device until
    ``reduce`` (5 bytes a sample and class: fp32 logit, bool target), and each class's lowest and
    highest logit so far. No host sync per batch."""

    def __init__(self, num_classes: int, bins: int, threshold: float, device: torch.device):
        self.num_classes, self.bins, self.threshold, self.device = num_classes, bins, threshold, device
        self.logits: list[torch.Tensor] = []
        self.positives: list[torch.Tensor] = []
        self.low = torch.full((num_classes,), torch.inf, device=device)
        self.high = torch.full((num_classes,), -torch.inf, device=device)

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Keep a batch: ``logits`` (N, C), ``targets`` multi-hot (N, C)."""
        if len(logits) == 0:  # amin/amax refuse an empty batch
            return
        x = finite_logits(logits)
        self.logits.append(x)
        self.positives.append(targets > 0.5)
        self.low = torch.minimum(self.low, x.amin(0))
        self.high = torch.maximum(self.high, x.amax(0))

    def reduce(self) -> dict[str, float]:
        """Sum the counts over ranks (collectives: every rank calls it); return the metrics, in percent.

        Two all-reduces: the classes' ranges (2 x C fp32, a maximum), then every count in one tensor.
        """
        extremes = all_reduce_max(torch.cat([self.high, -self.low]))
        high, low = extremes[: self.num_classes], -extremes[self.num_classes :]
        counts = all_reduce_sum(self.counts(low, high)).cpu().numpy()
        split = 2 * self.num_classes * self.bins
        levels = counts[:split].reshape(2, self.num_classes, self.bins)
        return metrics_from_counts(levels, counts[split:].reshape(3, self.num_classes))

    def counts(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """This rank's counts, flat: samples and positives at each level of each class, then true
        positives, false positives and false negatives of each class. int32: a count never exceeds the
        val set's size, and it halves the all-reduce."""
        c, bins = self.num_classes, self.bins
        levels = torch.zeros(2, c * bins, dtype=torch.int32, device=self.device)
        outcomes = torch.zeros(3, c, dtype=torch.int32, device=self.device)
        offsets = torch.arange(c, device=self.device) * bins
        for logits, positive in zip(self.logits, self.positives):  # a batch at a time: bounded temporaries
            cells = (score_levels(logits, low, high, bins) + offsets).flatten()
            # index_add_ of integer ones: exact in any order
            levels[0].index_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))
            hits = cells[positive.flatten()]
            levels[1].index_add_(0, hits, torch.ones_like(hits, dtype=torch.int32))
            pred = predicted(logits, self.threshold)
            outcomes += torch.stack([(pred & positive).sum(0), (pred & ~positive).sum(0), (~pred & positive).sum(0)])
        return torch.cat([levels.flatten(), outcomes.flatten()])


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
    # A block of classes at a time: the float64 cumulative sums of all classes at once would take
    # 6 x 8 x C x bins bytes (200 MB for 1,000 classes at 4,096 levels).
    ap = np.concatenate([average_precisions(levels[:, i : i + 64]) for i in range(0, levels.shape[1], 64)])
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
