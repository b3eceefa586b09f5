"""Optimizers (SGD, AdamW, LARS, LAMB, Muon with AdamW, optionally ZeRO-1 sharded) and the LR schedule as a pure function."""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError
from distribuuuu.logger import get_logger
from distribuuuu.models import named_blocks
from distribuuuu.training.muon import MuonWithAdamW, muon_parameter_names, split_for_muon

logger = get_logger("optim")


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decay_norm_bias: bool,
    head_lr_mult: float = 1.0,
    layer_decay: float = 0.0,
    no_weight_decay_names: tuple[str, ...] = (),
) -> list[dict]:
    """Group the trainable parameters by weight decay and LR scale.

    One-dimensional parameters are exactly the biases and the normalisation scales/shifts of
    torchvision and timm models; decaying them hurts accuracy (Goyal et al., 2017). Names from the
    model's ``no_weight_decay()`` (timm: position embeddings, class token, which are not 1-D) and
    ``no_weight_decay_names`` (fnmatch patterns) are not decayed either. ``lr_scale`` (timm's key)
    is what ``set_lr`` multiplies the schedule's LR by: ``head_lr_mult`` for the classifier and
    ``layer_decay ** (num_layers + 1 - layer_id)`` with layer-wise decay (0: off). With the
    defaults the groups are the plain decay / no-decay pair.
    """
    skip = tuple(no_weight_decay_names) + tuple(getattr(model, "no_weight_decay", lambda: ())())
    head = head_parameter_names(model) if head_lr_mult != 1.0 else set()
    layers, num_layers = layer_ids(model) if layer_decay > 0 else ({}, 0)
    groups: dict[tuple[bool, float], dict] = {}
    if not head and not layers:  # today's layout: the decay group first, even when empty
        groups[(True, 1.0)] = {"params": [], "weight_decay": weight_decay, "name": "decay", "lr_scale": 1.0}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen: keep it out of the optimizer and its state
            continue
        decay = (p.ndim > 1 or decay_norm_bias) and not any(fnmatch.fnmatchcase(name, pat) for pat in skip)
        scale = layer_decay ** (num_layers + 1 - layers[name]) if layers else 1.0
        scale *= head_lr_mult if name in head else 1.0
        if (decay, scale) not in groups:
            groups[(decay, scale)] = {
                "params": [],
                "weight_decay": weight_decay if decay else 0.0,
                "name": ("decay" if decay else "no_decay") + (f"_x{scale:.6g}" if scale != 1.0 else ""),
                "lr_scale": scale,
            }
        groups[(decay, scale)]["params"].append(p)
    return [g for k, g in groups.items() if g["params"] or k == (True, 1.0)]


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int]:
    """Map each parameter name to its layer for layer-wise LR decay; return it and the block count.

    The blocks are ``models.named_blocks``'s (the ones FSDP wraps and checkpointing recomputes),
    numbered 1..N in parameter order (the order of the forward pass in torchvision and timm).
    Parameters before the first block (patch/stem embedding, class token, position embedding) are
    layer 0; those between blocks (ConvNeXt's downsampling) go with the next block; those after
    the last (final norm, head) are layer N + 1, as in BEiT / MAE. Written here because
    torchvision models have no ``group_matcher`` (timm's layer-decay helper needs one).
    """
    blocks = {name for name, _ in named_blocks(model)}
    names = [name for name, _ in model.named_parameters()]
    prefixes = [_block_of(name, blocks) for name in names]
    order = list(dict.fromkeys(p for p in prefixes if p is not None))
    if not order:
        raise ValueError(f"layer-wise LR decay: no blocks found in {type(model).__name__}")
    block = {prefix: i + 1 for i, prefix in enumerate(order)}
    ids, pending, seen_block = {}, [], False
    for name, prefix in zip(names, prefixes):
        if prefix is None:
            pending.append(name)  # its layer is the next block's, or N + 1 after the last one
            if not seen_block:
                ids[name] = 0
            continue
        seen_block = True
        for waiting in pending:
            ids.setdefault(waiting, block[prefix])
        pending = []
        ids[name] = block[prefix]
    ids.update({name: len(order) + 1 for name in pending})
    return ids, len(order)


def _block_of(parameter: str, blocks: set[str]) -> str | None:
    """The block whose name prefixes ``parameter`` (``encoder.layers.encoder_layer_3``), or None."""
    parts = parameter.split(".")
    return next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in blocks), None)


def head_parameter_names(model: nn.Module) -> set[str]:
    """Names of the classifier's parameters: timm's ``get_classifier()``, a top-level
    ``fc``/``classifier``/``heads``/``head``, or else the module holding the last Linear."""
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
    else:
        named = dict(model.named_children())
        head = next((named[n] for n in ("fc", "classifier", "heads", "head") if n in named), None)
        if head is None:
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            if not linears:
                raise ValueError(f"no classifier found in {type(model).__name__}: it has no Linear layer")
            head = linears[-1]
    ids = {id(p) for p in head.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def freeze(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Set ``requires_grad=False`` on parameters whose name matches an fnmatch pattern; return their names.

    A pattern that matches nothing is an error: a typo would otherwise train what was meant frozen.
    """
    names = [name for name, _ in model.named_parameters()]
    unmatched = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unmatched:
        raise ValueError(f"freeze patterns match no parameter of {type(model).__name__}: {unmatched}")
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al., 2017).

    PyTorch has no LARS. As in You et al. and the large-batch ImageNet recipes, biases and norm
    parameters (ndim <= 1) get plain momentum SGD whatever their weight decay: adaptation follows
    the parameter, not the decay group. A group may opt out of adaptation with ``lars_adapt=False``.
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
                if group["lars_adapt"] and p.ndim > 1:
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


class LAMB(torch.optim.Optimizer):
    """Adam with decoupled weight decay and a layer-wise trust ratio ||w|| / ||update|| (You et al., 2019).

    PyTorch has no LAMB. Written here rather than taken from timm (``timm.optim.Lamb``, which a test
    matches) because timm is optional, so the update would change with what a machine has
    installed, and because timm's clips the global gradient norm by default and adapts only groups
    with weight decay. Here, as for LARS, parameters with ndim <= 1 are not adapted.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                update = (exp_avg / (1 - beta1 ** state["step"])).div_(denom)
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                if p.ndim > 1:
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                    update.mul_(torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0))
                p.add_(update, alpha=-group["lr"])
        return loss


def _optimizer_class_and_kwargs(o: CfgNode) -> tuple[type, dict]:
    if o.OPTIMIZER == "muon":
        muon = dict(momentum=o.MUON_MOMENTUM, nesterov=o.NESTEROV, adjust_lr_fn=o.MUON_ADJUST_LR)
        return MuonWithAdamW, dict(lr=o.BASE_LR, betas=tuple(o.BETAS), **muon)
    if o.OPTIMIZER == "adamw":
        return torch.optim.AdamW, dict(lr=o.BASE_LR, betas=tuple(o.BETAS))
    if o.OPTIMIZER == "lamb":
        return LAMB, dict(lr=o.BASE_LR, betas=tuple(o.BETAS))
    if o.OPTIMIZER == "lars":
        return LARS, dict(lr=o.BASE_LR, momentum=o.MOMENTUM, trust=o.LARS_TRUST)
    return torch.optim.SGD, dict(lr=o.BASE_LR, momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV)


# AdamW's LR (and Muon's with match_rms_adamw, which takes AdamW's) is ~1e-3 (DeiT: 5e-4 x batch/512);
# 0.01 and above is SGD's range: the default 0.05 left in place diverges or stalls an AdamW run.
ADAMW_LR_WARNING = 0.01


def _warn_if_an_sgd_lr(optim_cfg: CfgNode) -> None:
    if optim_cfg.OPTIMIZER in ("adamw", "muon") and optim_cfg.BASE_LR >= ADAMW_LR_WARNING:
        logger.warning(
            "OPTIM.BASE_LR %g with OPTIM.OPTIMIZER %s: an LR of SGD's range (its default is 0.05); AdamW's "
            "is about 1e-3 (docs/recipe.md)", optim_cfg.BASE_LR, optim_cfg.OPTIMIZER,
        )  # fmt: skip


def build_optimizer(
    model: nn.Module, optim_cfg: CfgNode, zero: bool = False, fused: bool = False
) -> torch.optim.Optimizer:
    """Build OPTIM.OPTIMIZER over the model's parameter groups; ZeRO-1 shards its state.

    AdamW (outside ZeRO-1) always takes PyTorch's fused kernel, sharded (DTensor) parameters
    included: on the CPU its step is ~10x faster than the default per-tensor loop (resnet18, one
    thread: 10.9 ms against 115.9 ms; docs/performance.md). ``fused`` (asked for with fp16 and bf16)
    picks the fused SGD kernel too: one kernel for every parameter's update, and with fp16 it takes
    GradScaler's overflow flag on the device and skips the update there, where any other optimizer
    makes GradScaler copy the flag to the host every step. LARS, ZeRO-1 and SGD with dampening keep
    the foreach loop (and that per-step sync). (Fused SGD only with 16-bit precision: it has no
    DTensor rule, and a checkpoint's optimizer groups carry the flag to a resumed run.)
    """
    _warn_if_an_sgd_lr(optim_cfg)
    groups = optimizer_groups(model, optim_cfg)
    cls, kwargs = _optimizer_class_and_kwargs(optim_cfg)
    if cls is MuonWithAdamW:
        groups = muon_groups(model, groups)
    if not zero:
        fused_sgd = cls is torch.optim.SGD and optim_cfg.DAMPENING == 0
        on_fused_devices = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
        if on_fused_devices and (cls in (torch.optim.AdamW, MuonWithAdamW) or (fused and fused_sgd)):
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


def muon_groups(model: nn.Module, groups: list[dict]) -> list[dict]:
    """``groups`` split for OPTIM.OPTIMIZER muon: hidden 2-D weights to Muon, the rest (and the head) to
    AdamW (training/muon.py); logged, with a warning when Muon gets nothing (a CNN's 4-D kernels)."""
    names = muon_parameter_names(model, head_parameter_names(model))
    params = dict(model.named_parameters())
    logger.info(
        "OPTIM.OPTIMIZER muon: %d weight matrices to Muon, %d other parameter tensors to AdamW",
        len(names), sum(len(g["params"]) for g in groups) - len(names),
    )  # fmt: skip
    if not names:
        logger.warning(
            "OPTIM.OPTIMIZER muon: %s has no 2-D hidden weight matrix (torch.optim.Muon takes 2-D parameters "
            "only; convolution kernels are 4-D): every parameter trains with AdamW", type(model).__name__,
        )  # fmt: skip
    return split_for_muon(groups, {id(params[name]) for name in names})


def optimizer_groups(model: nn.Module, optim_cfg: CfgNode) -> list[dict]:
    """``param_groups`` from the OPTIM keys; a model it cannot split is a ConfigError naming the key."""
    o = optim_cfg
    try:
        return param_groups(
            model, o.WEIGHT_DECAY, o.WEIGHT_DECAY_NORM_BIAS, o.HEAD_LR_MULT, o.LAYER_DECAY, tuple(o.NO_WEIGHT_DECAY)
        )
    except ValueError as e:  # no blocks for layer decay, no classifier for the head multiplier
        key = "OPTIM.LAYER_DECAY" if o.LAYER_DECAY > 0 and "layer-wise" in str(e) else "OPTIM.HEAD_LR_MULT"
        raise ConfigError(f"{key}: {e}") from None


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
    """Set every parameter group's learning rate to ``lr`` times its ``lr_scale`` (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
