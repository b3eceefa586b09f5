"""The suite's two tiny models, registered by name on import (``MODEL.ARCH tiny_cnn``, ``conv_bn_head``).

``tiny_cnn``: two conv-BN-ReLU blocks and a linear head, an epoch of 16x16 digits in about a second;
for runs whose property holds for any model. Its forward can inject faults at an exact step, read
from the environment when the module is imported (tests/scripts/tiny_train.py sets them):

- ``FAULT_NAN_CALLS="5,6"``: the training forward passes with these 1-based call numbers (counted
  per process) return NaN logits. With ACCUM_STEPS 1, forward call k is the k-th optimizer step.
- ``FAULT_INF_GRAD_CALLS="9"``: these forward passes are finite, but their backward pass gives the
  model's output an infinite gradient (the loss stays finite, the gradients do not).

``conv_bn_head``: one conv-BN-ReLU and a linear head, the least a BatchNorm model can be (the
device-collective tests run every op of it through a tensor subclass).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from distribuuuu.models import register_model

TINY_ARCH, CONV_BN_HEAD = "tiny_cnn", "conv_bn_head"
_NAN_CALLS = {int(c) for c in os.environ.get("FAULT_NAN_CALLS", "").split(",") if c}
_INF_GRAD_CALLS = {int(c) for c in os.environ.get("FAULT_INF_GRAD_CALLS", "").split(",") if c}


class _InfGradient(torch.autograd.Function):
    """Identity forward; an infinite gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class TinyNet(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(16, num_classes)
        self.train_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(self.features(x).flatten(1))
        if self.training:
            self.train_calls += 1
            if self.train_calls in _NAN_CALLS:
                out = out * float("nan")  # after BatchNorm: its running statistics stay finite
            if self.train_calls in _INF_GRAD_CALLS:
                out = _InfGradient.apply(out)
        return out


@register_model(TINY_ARCH)
def tiny_cnn(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return TinyNet(num_classes)


@register_model(CONV_BN_HEAD)
def conv_bn_head(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )  # fmt: skip
