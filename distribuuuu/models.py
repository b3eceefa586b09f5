"""Model registry: user-registered names, then torchvision, then timm (if installed)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from collections import OrderedDict
from typing import Callable

import torch
import torch.utils.checkpoint
import torchvision
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError, parse_model_kwargs
from distribuuuu.errors import first_line

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable:
    """Register ``fn(num_classes=..., pretrained=...) -> nn.Module`` under ``name`` (decorator)."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _REGISTRY[name] = fn
        return fn

    return wrap


def _timm():
    try:
        import timm
    except ImportError:
        return None
    return timm


def model_source(arch: str) -> str:
    """Return where ``arch`` comes from ("registry", "torchvision", "timm") or raise ConfigError."""
    if arch in _REGISTRY:
        return "registry"
    torchvision_names = torchvision.models.list_models(module=torchvision.models)
    if arch in torchvision_names:
        return "torchvision"
    timm = _timm()
    if timm is not None and timm.is_model(arch):
        return "timm"
    hint = "" if timm is not None else "; timm is not installed (pip install timm) for its models"
    close = difflib.get_close_matches(arch, [*_REGISTRY, *torchvision_names], n=1)
    raise ConfigError(
        f"MODEL.ARCH: unknown model {arch!r} (not registered, not a torchvision classification model{hint})"
        + (f": did you mean {close[0]}?" if close else "")
    )


def build_model(model_cfg: CfgNode) -> nn.Module:
    """Build MODEL.ARCH with MODEL.NUM_CLASSES outputs and MODEL.KWARGS, optionally from pretrained
    weights, with zero-initialised residual BatchNorm and gradient checkpointing as configured."""
    arch, num_classes = model_cfg.ARCH, model_cfg.NUM_CLASSES
    source, weights = model_source(arch), pretrained_weights(model_cfg)
    kwargs = parse_model_kwargs(model_cfg.KWARGS)
    try:
        if source == "registry":
            model = _REGISTRY[arch](num_classes=num_classes, pretrained=weights is not None, **kwargs)
        elif source == "timm":
            model = _create_timm(arch, weights, num_classes, kwargs)
        else:
            model = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
        if source == "torchvision" and weights is not None:
            _load_torchvision_pretrained(model, arch, weights)
    except TypeError as e:  # a keyword the constructor does not take
        raise ConfigError(f"MODEL.KWARGS {model_cfg.KWARGS}: {arch} refuses them ({first_line(e)})") from None
    except _NotFetched as e:  # named by the key the user set: MODEL.PRETRAINED_WEIGHTS wins over MODEL.PRETRAINED
        key = "MODEL.PRETRAINED_WEIGHTS" if model_cfg.PRETRAINED_WEIGHTS else "MODEL.PRETRAINED"
        off = "''" if model_cfg.PRETRAINED_WEIGHTS else "False"
        raise ConfigError(f"{key}: {e} or set {key} {off}") from None
    if model_cfg.ZERO_INIT_RESIDUAL and weights is None:  # pretrained scales are learned: kept
        zero_init_residual(model)
    if model_cfg.GRAD_CHECKPOINT:
        enable_grad_checkpointing(model)
    return model


def pretrained_weights(model_cfg: CfgNode) -> str | None:
    """The pretrained weights' name: MODEL.PRETRAINED_WEIGHTS, "DEFAULT" for MODEL.PRETRAINED, or None."""
    if model_cfg.PRETRAINED_WEIGHTS:
        return model_cfg.PRETRAINED_WEIGHTS
    return "DEFAULT" if model_cfg.PRETRAINED else None


class _NotFetched(Exception):
    """Pretrained weights that could not be loaded (an offline hub, a missing file): build_model names
    the key that asked for them."""


def timm_pretrained_cfg(model_cfg: CfgNode) -> dict | None:
    """A timm model's own preprocessing (mean, std, interpolation, crop_pct) when its pretrained
    weights are used, from ``timm.data.resolve_data_config``; None otherwise."""
    weights = pretrained_weights(model_cfg)
    if weights is None or model_source(model_cfg.ARCH) != "timm":
        return None
    timm = _timm()
    name = model_cfg.ARCH if weights == "DEFAULT" else f"{model_cfg.ARCH.split('.')[0]}.{weights}"
    pretrained = _timm_pretrained_cfg(name)
    if pretrained is None:
        return None  # _create_timm names the unknown tag
    return timm.data.resolve_data_config({}, pretrained_cfg=pretrained.to_dict())


def _timm_pretrained_cfg(name: str):
    """timm's pretrained config of "arch.tag", or None for an unknown tag (timm raises on some)."""
    try:
        return _timm().models.get_pretrained_cfg(name)
    except RuntimeError:
        return None


def _create_timm(arch: str, weights: str | None, num_classes: int, kwargs: dict) -> nn.Module:
    """timm.create_model with the pretrained tag ``weights`` ("DEFAULT": timm's default tag)."""
    timm = _timm()
    name = arch if weights in (None, "DEFAULT") else f"{arch.split('.')[0]}.{weights}"
    if weights not in (None, "DEFAULT") and _timm_pretrained_cfg(name) is None:
        tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{arch.split('.')[0]}.*")]
        raise ConfigError(f"MODEL.PRETRAINED_WEIGHTS: timm has no {weights!r} weights for {arch}; its tags: {tags}")
    try:
        return timm.create_model(name, pretrained=weights is not None, num_classes=num_classes, **kwargs)
    except (OSError, RuntimeError, ValueError) as e:  # offline hub, missing file
        if weights is None:
            raise  # not a download: timm's own error is the one to read
        raise _NotFetched(
            f"could not load pretrained weights for {name!r} ({type(e).__name__}: {first_line(e)}); cache them "
            "with timm first"
        ) from None


def torchvision_weights(arch: str, name: str) -> torchvision.models.WeightsEnum:
    """torchvision's weight enum member ``name`` of ``arch`` ("DEFAULT" included), or a ConfigError listing them."""
    enum = torchvision.models.get_model_weights(arch)
    try:
        return enum[name] if name != "DEFAULT" else enum.DEFAULT
    except KeyError:
        valid = ["DEFAULT", *(w.name for w in enum)]
        raise ConfigError(f"MODEL.PRETRAINED_WEIGHTS: {arch} has no weights {name!r}; valid names: {valid}") from None


def _load_torchvision_pretrained(model: nn.Module, arch: str, name: str = "DEFAULT") -> None:
    """Copy the pretrained weights of matching shape (a different class count keeps a new head)."""
    weights = torchvision_weights(arch, name)
    try:
        state = weights.get_state_dict(progress=False, check_hash=True)
    except Exception as e:
        raise _NotFetched(
            f"could not load pretrained weights for {arch!r} ({type(e).__name__}: {first_line(e)}); place the "
            f"file under {torch.hub.get_dir()}/checkpoints"
        ) from None
    own = model.state_dict()
    kept = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(kept, strict=False)
    if len(kept) < len(own):
        logger.info(
            "pretrained %s: new head for %d classes (%d tensors kept)", arch, model_num_classes(model), len(kept)
        )


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


def enable_grad_checkpointing(model: nn.Module) -> int:
    """Recompute the blocks' activations in the backward pass instead of storing them.

    timm models switch it on themselves (``set_grad_checkpointing``). Elsewhere each block of
    ``find_blocks`` runs its forward under ``torch.utils.checkpoint`` (non-reentrant). Return the
    number of blocks.
    """
    if hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
        return -1
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(f"MODEL.GRAD_CHECKPOINT: no repeated blocks found in {type(model).__name__}")
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block, block.forward)
    return len(blocks)


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


def versioned(weights: dict, model: nn.Module) -> dict:
    """``weights`` with the module versions ``load_state_dict`` hands each module: their own, else ``model``'s.

    ``state_dict()`` records each module's ``_version``, and a module may read it on load to
    upgrade an old layout (torchvision's MNASNet refuses to load without it). Dicts that lost them
    (a sharded checkpoint read whole, DCP's state dicts) were written by these same classes.
    """
    if getattr(weights, "_metadata", None) is not None:
        return weights
    out = OrderedDict(weights)
    out._metadata = OrderedDict((name, {"version": m._version}) for name, m in model.named_modules())
    return out


def load_model_weights(model: nn.Module, weights: dict, strict: bool = True):
    """``model.load_state_dict(weights)`` with module versions (``versioned``): what every load of whole weights calls."""
    return model.load_state_dict(versioned(weights, model), strict=strict)
