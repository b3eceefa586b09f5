"""train_net.py with a tiny registered CNN and fault injection, driven by environment variables.

The real entry point (``cli.run_tool(trainer.train_model)``) runs unchanged; only the model and
the hooks below are added, so a test can inject a fault at an exact, computable step:

- ``FAULT_NAN_CALLS="5,6"``: the training forward passes with these 1-based call numbers (counted
  per process) return NaN logits. With ACCUM_STEPS 1, forward call k is the k-th optimizer step.
- ``FAULT_INF_GRAD_CALLS="9"``: these forward passes are finite, but their backward pass gives the
  model's output an infinite gradient (the loss stays finite, the gradients do not).
- ``FAULT_FP16_INIT_SCALE=16777216``: the GradScaler starts at this scale (never grows within the run).
- ``FAULT_SIGNAL_AT_STEP=N`` (with ``FAULT_SIGNAL=SIGTERM|SIGUSR1``, ``FAULT_SIGNAL_RANK=0``): after
  global optimizer step N (1-based) the process sends itself the signal, as a scheduler would.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from distribuuuu import cli, trainer  # noqa: E402
from distribuuuu.models import register_model  # noqa: E402

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
    """Two conv-BN-ReLU blocks and a linear head: trains on 16x16 digits in about a second an epoch."""

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


@register_model("fault_tiny")
def fault_tiny(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return TinyNet(num_classes)


def _signal_hook() -> None:
    """Wrap trainer.train_step so that this rank signals itself after a given global step."""
    at = int(os.environ.get("FAULT_SIGNAL_AT_STEP", "0"))
    if not at or int(os.environ.get("RANK", "0")) != int(os.environ.get("FAULT_SIGNAL_RANK", "0")):
        return
    sig = getattr(signal, os.environ.get("FAULT_SIGNAL", "SIGTERM"))
    real_step = trainer.train_step

    def train_step(run, micro_batches, sums):
        loss = real_step(run, micro_batches, sums)
        if run.global_step + 1 == at:  # global_step still counts the steps before this one
            os.kill(os.getpid(), sig)
        return loss

    trainer.train_step = train_step


def _scaler_hook() -> None:
    """Wrap trainer.build_run so that the fp16 GradScaler starts at FAULT_FP16_INIT_SCALE."""
    init_scale = float(os.environ.get("FAULT_FP16_INIT_SCALE", "0"))
    if not init_scale:
        return
    real_build_run = trainer.build_run

    def build_run(cfg, env, writer):
        run = real_build_run(cfg, env, writer)
        run.scaler = torch.amp.GradScaler(env.device.type, init_scale=init_scale, growth_interval=10**6)
        return run

    trainer.build_run = build_run


if __name__ == "__main__":
    _signal_hook()
    _scaler_hook()
    sys.exit(cli.run_tool(trainer.train_model, description=__doc__))
