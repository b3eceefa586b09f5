"""Training losses by name (TRAIN.LOSS): cross-entropy or binary cross-entropy (timm A1, DeiT III),
optionally class-weighted; multi-label BCE; knowledge distillation's loss.

``LOSSES`` is the one registry of TRAIN.LOSS's names: the config's rules read it, and
``training/task.py`` builds a task's criterion from it. Knows nothing of the config."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class BinaryCrossEntropy(nn.Module):
    """BCE-with-logits over one-hot or soft targets, averaged over samples and classes.

    The formulas of timm's ``BinaryCrossEntropy``, written here because timm is an optional extra:
    hard labels become ``smoothing / C`` off and ``1 - smoothing + smoothing / C`` on; soft targets
    (mixup, cutmix) are taken as they come; ``target_threshold`` then turns every target above it
    into 1 and the rest into 0, as DeiT III and timm's A1 recipe do with mixed targets.
    ``weight`` (one per class) scales each class's column of the loss.
    """

    def __init__(
        self, smoothing: float = 0.0, target_threshold: float | None = None, weight: torch.Tensor | None = None
    ):
        super().__init__()
        self.smoothing, self.target_threshold = smoothing, target_threshold
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.shape != logits.shape:  # hard labels
            num_classes = logits.size(-1)
            off = self.smoothing / num_classes
            target = torch.full_like(logits, off).scatter_(1, target.long().view(-1, 1), 1.0 - self.smoothing + off)
        if self.target_threshold is not None:
            target = target.gt(self.target_threshold).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), weight=self.weight)


class MultiLabelBCE(nn.Module):
    """Per-class sigmoid BCE over multi-hot (or mixed) targets, averaged over samples and classes
    (MODEL.TASK multilabel).

    Label smoothing moves every target towards 1/2, ``t (1 - smoothing) + smoothing / 2``: each
    class is its own binary problem, so the smoothing of two-class cross-entropy. ``pos_weight``
    (one per class) weights the positive term, as PyTorch's BCEWithLogitsLoss does.
    """

    def __init__(self, smoothing: float = 0.0, pos_weight: torch.Tensor | None = None):
        super().__init__()
        self.smoothing = smoothing
        self.register_buffer("pos_weight", pos_weight, persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.to(logits.dtype)
        if self.smoothing:
            target = target * (1.0 - self.smoothing) + self.smoothing / 2
        return F.binary_cross_entropy_with_logits(logits, target, pos_weight=self.pos_weight)


def cross_entropy(smoothing: float = 0.0, target_threshold: float | None = None, weight=None) -> nn.Module:
    """PyTorch's cross-entropy with label smoothing (``target_threshold`` is BCE's alone).

    With class weights, each sample is weighted by its class's weight (soft targets: each class's
    term) and, for hard labels, the mean divides by the summed weights of the batch (PyTorch's mean).
    """
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=smoothing)


# TRAIN.LOSS -> its builder(smoothing, target_threshold, weight) of a one-class-an-image loss.
LOSSES: dict[str, Callable[..., nn.Module]] = {"ce": cross_entropy, "bce": BinaryCrossEntropy}


def positive_weights(positives: torch.Tensor, samples: int) -> torch.Tensor:
    """Each class's positive weight ``negatives / positives`` (a multi-label class's "balanced"
    weight: its positive and negative terms then weigh alike). A class without positives is an error."""
    empty = torch.nonzero(positives == 0).flatten().tolist()
    if empty:
        raise ValueError(f"class weights: classes {empty} have no samples")
    return ((samples - positives) / positives.double()).float()


class DistillationLoss(nn.Module):
    """``(1 - alpha) * task + alpha * distillation`` of the student's logits against a teacher's.

    Soft (Hinton et al.): ``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over
    the batch; the ``T^2`` keeps the soft term's gradients at the task loss's scale as T grows.
    Hard (DeiT's hard distillation): cross-entropy against the teacher's argmax, as if it were
    the label (T unused). ``task`` is the training loss on the (possibly mixed) targets.
    """

    def __init__(self, task: nn.Module, alpha: float, temperature: float = 1.0, hard: bool = False):
        super().__init__()
        self.task, self.alpha, self.temperature, self.hard = task, alpha, temperature, hard

    def forward(self, logits: torch.Tensor, target: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        task = self.task(logits, target)
        return (1.0 - self.alpha) * task + self.alpha * self.distillation(logits, teacher_logits.to(logits.dtype))

    def distillation(self, logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """The distillation term alone: soft KL at temperature T (times T^2), or CE on the teacher's argmax."""
        if self.hard:
            return F.cross_entropy(logits, teacher_logits.argmax(dim=1))
        t = self.temperature
        student, teacher = F.log_softmax(logits / t, dim=1), F.log_softmax(teacher_logits / t, dim=1)
        return F.kl_div(student, teacher, reduction="batchmean", log_target=True) * (t * t)
