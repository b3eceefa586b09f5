"""Optimizers (SGD, AdamW, LARS, optionally ZeRO-1 sharded) and the LR schedule as a pure function."""

from __future__ import annotations

import math

import torch
from torch import nn
from yacs.config import CfgNode


def param_groups(model: nn.Module, weight_decay: float, decay_norm_bias: bool) -> list[dict]:
    """Split parameters into a decayed group and a no-decay group (biases and norm weights).

    One-dimensional parameters are exactly the biases and the normalisation scales/shifts of
    torchvision and timm models; decaying them hurts accuracy (Goyal et al., 2017).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 and not decay_norm_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay", "lars_adapt": True}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay", "lars_adapt": False})
    return groups


class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al., 2017).

    PyTorch has no LARS. Groups with ``lars_adapt=False`` (biases, norm weights) get plain
    momentum SGD, as in the large-batch ImageNet recipes.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, trust: float = 0.001):
        super().__init__(
            params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust=trust, lars_adapt=True)
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                if group["lars_adapt"]:
                    p_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
                    trust = torch.where((p_norm > 0) & (g_norm > 0), group["trust"] * p_norm / g_norm, 1.0)
                    grad = grad * trust
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = grad.clone()
                else:
                    buf.mul_(group["momentum"]).add_(grad)
                p.add_(buf, alpha=-group["lr"])
        return loss


def _optimizer_class_and_kwargs(o: CfgNode) -> tuple[type, dict]:
    if o.OPTIMIZER == "adamw":
        return torch.optim.AdamW, dict(lr=o.BASE_LR, betas=tuple(o.BETAS))
    if o.OPTIMIZER == "lars":
        return LARS, dict(lr=o.BASE_LR, momentum=o.MOMENTUM, trust=o.LARS_TRUST)
    return torch.optim.SGD, dict(lr=o.BASE_LR, momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV)


def build_optimizer(
    model: nn.Module, optim_cfg: CfgNode, zero: bool = False, fused: bool = False
) -> torch.optim.Optimizer:
    """Build OPTIM.OPTIMIZER over the model's parameter groups; ZeRO-1 shards its state.

    ``fused`` (asked for with fp16) picks PyTorch's fused AdamW and SGD kernels: they take
    GradScaler's overflow flag on the device and skip the update there, where any other optimizer
    makes GradScaler copy the flag to the host every step. LARS, ZeRO-1 and SGD with dampening
    keep that per-step sync.
    """
    groups = param_groups(model, optim_cfg.WEIGHT_DECAY, optim_cfg.WEIGHT_DECAY_NORM_BIAS)
    cls, kwargs = _optimizer_class_and_kwargs(optim_cfg)
    if not zero:
        fused_sgd = cls is torch.optim.SGD and optim_cfg.DAMPENING == 0
        if fused and (cls is torch.optim.AdamW or fused_sgd):
            kwargs["fused"] = True
        optimizer = cls(groups, **kwargs)
        if kwargs.get("fused") and fused_sgd and optim_cfg.MOMENTUM > 0:
            _zero_momentum_buffers(optimizer)
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # ZeroRedundancyOptimizer takes the first group at construction and the rest via add_param_group.
    optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, **kwargs)
    optimizer.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
    for group in groups[1:]:
        optimizer.add_param_group(group)
    return optimizer


def _zero_momentum_buffers(optimizer: torch.optim.SGD) -> None:
    """Start fused SGD with zero momentum buffers.

    PyTorch's fused SGD creates a missing buffer with ``torch.empty`` and leaves it unwritten when
    GradScaler skips that step (seen with torch 2.14 on the CPU): the garbage then enters the next
    update. With dampening 0, a zero buffer gives the same first step: 0 x momentum + gradient.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def scaled_base_lr(optim_cfg: CfgNode, global_batch: int) -> float:
    """BASE_LR, scaled by global_batch / REFERENCE_BATCH when the linear scaling rule is on."""
    if optim_cfg.REFERENCE_BATCH > 0:
        return optim_cfg.BASE_LR * global_batch / optim_cfg.REFERENCE_BATCH
    return optim_cfg.BASE_LR


def lr_at(step: int, steps_per_epoch: int, optim_cfg: CfgNode, base_lr: float | None = None) -> float:
    """Learning rate at optimizer step ``step`` (0-based), with per-step linear warmup."""
    o = optim_cfg
    base = o.BASE_LR if base_lr is None else base_lr
    epoch = step / steps_per_epoch  # fractional epoch: the schedule moves every step
    if o.LR_POLICY == "cos":
        lr = o.MIN_LR + (base - o.MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * epoch / o.MAX_EPOCH))
    elif o.LR_POLICY == "lin":
        lr = base - (base - o.MIN_LR) * epoch / o.MAX_EPOCH
    else:  # steps
        lr = base * o.LR_MULT ** sum(1 for s in o.STEPS if epoch >= s)
    if epoch < o.WARMUP_EPOCHS:
        alpha = epoch / o.WARMUP_EPOCHS
        lr *= o.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
