"""MODEL.TASK, decided once: what a sample's target is, and how the model's outputs are trained,
scored and read.

``multiclass``: one class an image (class indices; softmax, cross-entropy, top-k accuracy).
``multilabel``: any number of classes an image (multi-hot targets; per-class sigmoid, BCE, mAP and
F1 at TEST.THRESHOLD). ``build_task`` picks one from the config; everything that differs between
the two is a method here, so no other module compares the task's name.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from distribuuuu.data.samplers import inverse_frequency_weights
from distribuuuu.losses import LOSSES, MultiLabelBCE, positive_weights
from distribuuuu.records.multilabel import MultiLabelSums


class Task(abc.ABC):
    """What both tasks share: the model's outputs (MODEL.NUM_CLASSES), TEST.THRESHOLD and TEST.AP_BINS."""

    name = ""
    multilabel = False  # what the data layer is told: class indices, or multi-hot targets

    def __init__(self, num_classes: int, threshold: float = 0.5, ap_bins: int = 4096):
        self.num_classes, self.threshold, self.ap_bins = num_classes, threshold, ap_bins

    def head_meaning(self) -> dict:
        """The task an export's logits serve (ONNX metadata): its name, and where it differs from
        softmax logits, its threshold and what the output means (``output``)."""
        return {"task": self.name}

    def reported_k(self, topk: int) -> int | None:
        """TRAIN.TOPK, or None when the model has no more classes than that: its top-k is always 100%."""
        return topk if topk < self.num_classes else None

    @abc.abstractmethod
    def criterion(
        self, loss: str, smoothing: float, bce_threshold: float | None, weights: torch.Tensor | None
    ) -> nn.Module:
        """The training loss: TRAIN.LOSS with label smoothing, the BCE threshold, class weights."""

    @abc.abstractmethod
    def balanced_weights(self, targets: list, classes: int) -> torch.Tensor:
        """TRAIN.CLASS_WEIGHTS balanced: one weight per class of the dataset, from the samples' ``targets``."""

    @abc.abstractmethod
    def val_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss evaluation reports."""

    @abc.abstractmethod
    def label_sums(self, device: torch.device) -> MultiLabelSums | None:
        """The per-class counts an evaluation keeps beside top-k, if any."""

    @abc.abstractmethod
    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's outputs as probabilities."""

    def chosen(self, scores: torch.Tensor, k: int) -> list[tuple[list[int], list[float]]]:
        """Each row's ``k`` best classes by score and their scores, best first."""
        values, indices = scores.topk(k, dim=-1)
        return list(zip(indices.tolist(), values.tolist()))

    @abc.abstractmethod
    def predicted(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Which classes a threshold predicts (bool, the shape of ``scores``), or None where the
        ranking alone is the reading."""


class MultiClass(Task):
    """One class an image: class-index targets, softmax over the head, top-k accuracy."""

    name = "multiclass"

    def criterion(
        self, loss: str, smoothing: float, bce_threshold: float | None, weights: torch.Tensor | None
    ) -> nn.Module:
        """TRAIN.LOSS from the registry (``losses.LOSSES``), with label smoothing and class weights."""
        return LOSSES[loss](smoothing, bce_threshold, weights)

    def balanced_weights(self, targets: list, classes: int) -> torch.Tensor:
        """TRAIN.CLASS_WEIGHTS balanced over the dataset's ``classes``: each class weighted by the
        inverse of its share of the samples' ``targets``."""
        return inverse_frequency_weights(torch.as_tensor(targets, dtype=torch.int64), classes)

    def val_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets)

    def label_sums(self, device: torch.device) -> MultiLabelSums | None:
        """The per-class counts an evaluation keeps beside top-k (none for one class an image)."""
        return None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's outputs as probabilities: softmax over the classes."""
        return logits.float().softmax(dim=-1)

    def predicted(self, scores: torch.Tensor) -> None:
        """None: one class an image, read as the top-k."""
        return None


class MultiLabel(Task):
    """Any number of classes an image: multi-hot targets, a sigmoid per class, mAP and F1 at the threshold."""

    name = "multilabel"
    multilabel = True

    def criterion(
        self, loss: str, smoothing: float, bce_threshold: float | None, weights: torch.Tensor | None
    ) -> nn.Module:
        """Per-class sigmoid BCE whatever TRAIN.LOSS says; class weights weigh the positives."""
        return MultiLabelBCE(smoothing, weights)

    def balanced_weights(self, targets: list, classes: int) -> torch.Tensor:
        """Each class's positive weight, negatives / positives: its two terms then weigh alike."""
        counts = torch.zeros(classes, dtype=torch.int64)
        for target in targets:
            counts[list(target) if isinstance(target, tuple) else target] += 1
        return positive_weights(counts, len(targets))

    def val_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype))

    def label_sums(self, device: torch.device) -> MultiLabelSums:
        return MultiLabelSums(self.num_classes, self.ap_bins, self.threshold, device)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits.float())

    def predicted(self, scores: torch.Tensor) -> torch.Tensor:
        """The classes whose sigmoid score is at least the threshold (TEST.THRESHOLD)."""
        return scores >= self.threshold

    def head_meaning(self) -> dict:
        meaning = "logits (sigmoid per class; a class is predicted when its score >= threshold)"
        return {"task": self.name, "threshold": self.threshold, "output": meaning}


TASKS = {task.name: task for task in (MultiClass, MultiLabel)}


def build_task(model_cfg, test_cfg) -> Task:
    """MODEL.TASK with MODEL.NUM_CLASSES outputs, TEST.THRESHOLD and TEST.AP_BINS."""
    return TASKS[model_cfg.TASK](model_cfg.NUM_CLASSES, test_cfg.THRESHOLD, test_cfg.AP_BINS)
