"""The model zoo: user-registered names, then torchvision, then timm (if installed); pretrained weights."""

from __future__ import annotations

import difflib
import logging
import os
import pickle
from typing import Callable

import torch
import torchvision
from torch import nn

from distribuuuu.errors import ConfigError, first_line, refused_global
from distribuuuu.models.anatomy import enable_activation_checkpointing, model_num_classes, zero_init_residual

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


def build_model(
    arch: str,
    num_classes: int,
    kwargs: dict | None = None,
    pretrained: str | None = None,
    zero_init_last: bool = False,
    checkpointing: str = "none",
    checkpoint_every: int = 1,
) -> nn.Module:
    """Build ``arch`` with ``num_classes`` outputs and constructor ``kwargs``, from the ``pretrained``
    weights of that name ("DEFAULT": the architecture's default; None: random), with zero-initialised
    residual BatchNorm (``zero_init_last``, random weights only) and activation ``checkpointing``
    ("none", "full" or "selective": every ``checkpoint_every``-th block; ``enable_activation_checkpointing``).

    A keyword the constructor does not take is its TypeError; pretrained weights that cannot be
    loaded are ``NotFetched``; an unknown architecture a ConfigError naming MODEL.ARCH."""
    source, kwargs = model_source(arch), kwargs or {}
    if source == "registry":
        model = _REGISTRY[arch](num_classes=num_classes, pretrained=pretrained is not None, **kwargs)
    elif source == "timm":
        model = _create_timm(arch, pretrained, num_classes, kwargs)
    else:
        model = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    if source == "torchvision" and pretrained is not None:
        _load_torchvision_pretrained(model, arch, pretrained)
    if zero_init_last and pretrained is None:  # pretrained scales are learned: kept
        zero_init_residual(model)
    enable_activation_checkpointing(model, checkpointing, checkpoint_every)
    return model


class NotFetched(Exception):
    """Pretrained weights that could not be loaded (an offline hub, a missing file): the caller names
    the key that asked for them."""


def timm_pretrained_cfg(arch: str, weights: str | None) -> dict | None:
    """A timm model's own preprocessing (mean, std, interpolation, crop_pct) when its ``weights`` are
    used ("DEFAULT": timm's default tag), from ``timm.data.resolve_data_config``; None otherwise."""
    if weights is None or model_source(arch) != "timm":
        return None
    timm = _timm()
    name = arch if weights == "DEFAULT" else f"{arch.split('.')[0]}.{weights}"
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
        raise NotFetched(
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
        # weights_only: torchvision's default is False, and it checks the hash of a file only as it
        # downloads it: a file placed in the hub's cache (as offline machines do) is anyone's.
        state = weights.get_state_dict(progress=False, check_hash=True, weights_only=True)
    except pickle.UnpicklingError as e:
        cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        raise NotFetched(
            f"refusing to load {cached}: it holds objects that weights_only=True does not allow "
            f"({refused_global(e)}); remove it"
        ) from None
    except Exception as e:
        raise NotFetched(
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
