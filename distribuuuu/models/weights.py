"""Whole weights into a model: with the module versions each module reads on load."""

from __future__ import annotations

from collections import OrderedDict

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
