"""Exponential moving average of model weights."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distribuuuu.models import load_model_weights


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place updates reach the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


class ModelEMA:
    """EMA of a model's parameters and floating-point buffers, with optional decay warmup.

    ``ema = d * ema + (1 - d) * weights`` with ``d = min(decay, (1 + n) / (10 + n))`` for the
    n-th update when ``warmup`` is on. Written here rather than with ``AveragedModel``: that
    class reads its update counter from a device tensor (a host sync per update) and has no
    decay warmup, which short runs need so the average is not dominated by initial weights.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0

    @classmethod
    def owning(cls, module: nn.Module, decay: float, warmup: bool = True) -> ModelEMA:
        """An EMA that averages into ``module`` itself, a copy the caller made.

        For FSDP2, whose sharded modules refuse ``deepcopy``: copy the plain model, shard the copy
        as the model is sharded, and pass it here; the average then lives in the same shards.
        """
        ema = cls.__new__(cls)
        ema.module = module.eval().requires_grad_(False)
        ema.decay, ema.warmup, ema.updates = decay, warmup, 0
        return ema

    def current_decay(self) -> float:
        """Decay used by the next update."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s current weights (no host sync)."""
        weight = 1.0 - self.current_decay()
        ema_state, state = self.module.state_dict(), model.state_dict()
        floats = [k for k, v in ema_state.items() if v.is_floating_point()]
        # Under FSDP2 parameters are DTensors and buffers plain tensors, which one foreach call
        # cannot mix; the EMA is sharded as the model is, so the local shards line up one to one.
        torch._foreach_lerp_([_local(ema_state[k]) for k in floats], [_local(state[k]) for k in floats], weight)
        for k, v in ema_state.items():
            if not v.is_floating_point():
                v.copy_(state[k])  # integer buffers (BatchNorm's num_batches_tracked) are copied
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        load_model_weights(self.module, state["module"])
        self.updates = int(state["updates"])
