"""Model registry: user-registered names, then torchvision, then timm (if installed)."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torchvision
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError
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
    if arch in torchvision.models.list_models(module=torchvision.models):
        return "torchvision"
    timm = _timm()
    if timm is not None and timm.is_model(arch):
        return "timm"
    hint = "" if timm is not None else "; timm is not installed (pip install timm) for its models"
    raise ConfigError(
        f"MODEL.ARCH: unknown model {arch!r} (not registered, not a torchvision classification model{hint})"
    )


def build_model(model_cfg: CfgNode) -> nn.Module:
    """Build MODEL.ARCH with MODEL.NUM_CLASSES outputs, optionally from pretrained weights."""
    arch, num_classes, pretrained = model_cfg.ARCH, model_cfg.NUM_CLASSES, model_cfg.PRETRAINED
    source = model_source(arch)
    if source == "registry":
        return _REGISTRY[arch](num_classes=num_classes, pretrained=pretrained)
    if source == "timm":
        return _timm().create_model(arch, pretrained=pretrained, num_classes=num_classes)
    model = torchvision.models.get_model(arch, num_classes=num_classes)
    if pretrained:
        _load_torchvision_pretrained(model, arch)
    return model


def _load_torchvision_pretrained(model: nn.Module, arch: str) -> None:
    """Copy the pretrained weights of matching shape (a different class count keeps a new head)."""
    try:
        weights = torchvision.models.get_model_weights(arch).DEFAULT
        state = weights.get_state_dict(progress=False, check_hash=True)
    except Exception as e:
        raise ConfigError(
            f"MODEL.PRETRAINED: could not load pretrained weights for {arch!r} ({type(e).__name__}: "
            f"{first_line(e)}); place the file under "
            f"{torch.hub.get_dir()}/checkpoints or set MODEL.PRETRAINED False"
        ) from None
    own = model.state_dict()
    kept = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(kept, strict=False)
    if len(kept) < len(own):
        logger.info(
            "pretrained %s: new head for %d classes (%d tensors kept)", arch, model_num_classes(model), len(kept)
        )


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
