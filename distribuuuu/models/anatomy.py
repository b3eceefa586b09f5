"""A model's anatomy: its repeated blocks (the one finder behind FSDP wrapping, activation checkpointing
and layer-wise LR decay), its BatchNorms, its wrappers, and the changes made to it in place
(zero-initialised residual branches, checkpointed blocks)."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from distribuuuu.errors import ConfigError

logger = logging.getLogger("distribuuuu.models")

# torchvision's ResNet, ResNeXt, Wide ResNet and RegNet blocks, whose residual branch's last BatchNorm
# is zeroed so that each block starts as the identity: what timm zero-initialises by default (its
# ResNets' and RegNets' zero_init_last). MobileNet's and EfficientNet's inverted residuals are
# left alone, as both timm and torchvision leave them (and ShuffleNet's concatenates, adds nothing).
_RESIDUAL_BLOCKS = ("BasicBlock", "Bottleneck", "ResBottleneckBlock")
_SHORTCUTS = ("downsample", "proj", "shortcut")


def zero_init_residual(model: nn.Module) -> int:
    """Zero the last BatchNorm scale of each residual block (Goyal et al., 2017); return how many.

    timm's blocks know their own (``zero_init_last``); torchvision's are found by class name, and
    the shortcut's BatchNorm (``downsample``) is left alone, as torchvision's ``zero_init_residual``.
    A model without such blocks (AlexNet, VGG, MobileNet, a ViT) is left as built, as timm's are.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "zero_init_last"):
            module.zero_init_last()
            count += 1
        elif type(module).__name__ in _RESIDUAL_BLOCKS:
            norms = [
                m
                for name, m in module.named_modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and not name.startswith(_SHORTCUTS)
            ]
            if norms:
                nn.init.zeros_(norms[-1].weight)
                count += 1
    if not count:
        logger.info(
            "MODEL.ZERO_INIT_RESIDUAL: %s has no residual block with a BatchNorm: left as built", type(model).__name__
        )
    return count


def enable_activation_checkpointing(model: nn.Module, mode: str = "full", every: int = 1) -> int:
    """Recompute blocks' activations in the backward pass instead of storing them; return how many
    blocks (-1: a timm model's own, every block).

    ``mode`` "full": every block of ``find_blocks``; "selective": every ``every``-th of them (blocks
    ``every``, 2 x ``every``, ... counted from 1, torchtitan's per-layer selective checkpointing);
    "none": nothing. Each chosen block runs its forward under ``torch.utils.checkpoint``
    (non-reentrant), with BatchNorm's running statistics left alone by the recomputation. A timm
    model without BatchNorm checkpoints itself in full (``set_grad_checkpointing``, non-reentrant);
    one with BatchNorm is wrapped here instead: timm's recomputation updates the running statistics
    a second time (``num_batches_tracked`` counts 2 a step).
    """
    if mode == "none":
        return 0
    if mode == "full" and hasattr(model, "set_grad_checkpointing") and not has_batchnorm(model):
        model.set_grad_checkpointing(True)
        logger.info("activation checkpointing: %s checkpoints its own blocks (timm)", type(model).__name__)
        return -1
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(f"MODEL.ACTIVATION_CHECKPOINTING: no repeated blocks found in {type(model).__name__}")
    chosen = blocks if mode == "full" else blocks[every - 1 :: every]
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block, block.forward)
    logger.info(
        "activation checkpointing (%s): %d of the %d blocks recomputed in backward", mode, len(chosen), len(blocks)
    )
    return len(chosen)


def enable_grad_checkpointing(model: nn.Module) -> int:
    """MODEL.GRAD_CHECKPOINT, the original key: ``enable_activation_checkpointing`` in full."""
    return enable_activation_checkpointing(model, "full")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, in forward order (see ``named_blocks``)."""
    return [block for _, block in named_blocks(model)]


def named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the model's repeated blocks, in forward order: the one finder behind FSDP
    wrapping, gradient checkpointing and layer-wise LR decay.

    A model may name its own with a ``fsdp_blocks`` attribute (modules) or method (returning them).
    Otherwise a block is a module with parameters and children of its own that sits in a container
    (``nn.Sequential``/``nn.ModuleList`` or a subclass, looked through as a stage, as are
    torchvision's ``Conv2dNormActivation`` stems): ResNet's BasicBlocks, ViT's encoder blocks,
    ConvNeXt's CNBlocks, EfficientNet's MBConvs. A candidate that holds two or more blocks of one
    class is a stage, and those blocks are taken instead (timm's ``stages.N.blocks.M``). Leaves and
    downsampling layers (plain containers, or a module beside stages, as Swin's PatchMerging) are no
    blocks: FSDP leaves them to the root, layer decay gives them the next block's layer. Written
    here because neither torchvision nor timm has one finder for all models (timm's
    ``group_matcher`` is timm-only).
    """
    own = getattr(model, "fsdp_blocks", None)
    if own is not None:
        names = {id(m): name for name, m in model.named_modules()}
        return [(names[id(m)], m) for m in (own() if callable(own) else own)]
    return _blocks_below(model, "", _is_container(model))


def _blocks_below(module: nn.Module, prefix: str, in_container: bool) -> list[tuple[str, nn.Module]]:
    stages, candidates, found = [], [], []  # in forward order; candidates beside stages are dropped below
    for name, child in module.named_children():
        path = prefix + name
        if _is_container(child):
            blocks = _blocks_below(child, path + ".", True)
            stages += blocks
        elif in_container and next(child.children(), None) is not None and next(child.parameters(), None) is not None:
            inner = _blocks_below(child, path + ".", False)
            is_stage = len(inner) >= 2 and len({type(m) for _, m in inner}) == 1
            blocks = inner if is_stage else [(path, child)]
            (stages if is_stage else candidates).extend(blocks)
        else:
            blocks = _blocks_below(child, path + ".", False)
        found += blocks
    # Beside stages that hold blocks, a module of its own is a transition (Swin's PatchMerging), not a block.
    return [b for b in found if not (stages and b in candidates)]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.Sequential, nn.ModuleList))


def _checkpointed(block: nn.Module, forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save memory on
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Dynamo refuses a context_fn, and needs none: a compiled graph applies a buffer's update
        # once, in its forward, and the recomputation in its backward mutates nothing.
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, context_fn=lambda: _recompute_contexts(block), **kwargs
    )


def _recompute_contexts(block: nn.Module):
    """The recomputation must not update BatchNorm's running statistics a second time."""
    return contextlib.nullcontext(), _frozen_running_stats(block)


@contextlib.contextmanager
def _frozen_running_stats(block: nn.Module):
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0  # running = (1 - 0) x running + 0 x batch: unchanged
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)


def model_num_classes(model: nn.Module) -> int:
    """Best-effort output size of a classifier (for log messages)."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return last[-1].out_features if last else -1


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (of the unwrapped model)."""
    params = unwrap_model(model).parameters()
    return sum(p.numel() for p in params if p.requires_grad or not trainable_only)


def has_batchnorm(model: nn.Module) -> bool:
    """True if the model contains BatchNorm layers."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
