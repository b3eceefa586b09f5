"""Whole weights into a model: with the module versions each module reads on load; how weights fit a model."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from torch import nn


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


class WeightsFit(NamedTuple):
    """How a state dict fits a model's: the model's tensors it fills (same name and shape), those it
    lacks, its own that the model lacks, those of another shape, and the share of the model's values filled."""

    filled: list[str]
    missing: list[str]
    unexpected: list[str]
    other_shape: list[str]
    share: float

    def shortfall(self) -> str:
        """What does not fit, in words: "14 missing, 9 unexpected, 0 of another shape"."""
        return (
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, {len(self.other_shape)} of another shape"
        )


def weights_fit(own: dict, weights: dict) -> WeightsFit:
    """How ``weights`` fit ``own`` (a model's state dict), by name and shape; the share is by number
    of values (elements), so a new head, a few tensors of many, barely lowers it."""
    shared = own.keys() & weights.keys()
    other_shape = sorted(k for k in shared if own[k].shape != weights[k].shape)
    filled = sorted(shared - set(other_shape))
    values = sum(v.numel() for v in own.values())
    share = sum(own[k].numel() for k in filled) / values if values else 1.0
    return WeightsFit(
        filled, sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys()), other_shape, share
    )
