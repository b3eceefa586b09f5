"""A checkpoint converted between its two formats (tools/convert_checkpoint.py): a sharded folder read
whole into one file, or one file sharded through a model (and optimizer) built as its run built them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from distribuuuu.checkpointing.sharded import read_full_state, save_states
from distribuuuu.checkpointing.single_file import load_file, model_state_from, save_checkpoint
from distribuuuu.models import load_model_weights
from distribuuuu.training.components import EMAShards, ModelShards, OptimizerShards
from distribuuuu.training.ema import ModelEMA


def tensor_states(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, ema: ModelEMA | None = None
) -> dict[str, Stateful]:
    """The DCP views of a model and, if given, its optimizer and EMA, under the keys a checkpoint holds."""
    states: dict[str, Stateful] = {"model": ModelShards(model)}
    if optimizer is not None:
        states["optimizer"] = OptimizerShards(model, optimizer)
    if ema is not None:
        states["ema"] = EMAShards(ema)
    return states


def save_sharded(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict, ema: ModelEMA | None = None
) -> None:
    """Write ``model``, ``optimizer`` and ``ema`` (if given) and ``extra`` to the directory ``path`` (collective)."""
    save_states(path, tensor_states(model, optimizer, ema), dict(extra, ema_updates=ema.updates if ema else 0))


def from_single_file(path: str, dcp_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Convert today's single-file checkpoint to a sharded one through ``model`` and ``optimizer``.

    They must be built as the run that wrote ``path`` built them (its cfg is in the file): the
    file numbers optimizer state by position, and only the optimizer knows each position's name.
    """
    state = load_file(path)
    load_model_weights(model, model_state_from(state))
    if optimizer is not None and state.get("optimizer"):
        optimizer.load_state_dict(state["optimizer"])
    ema = None
    if state.get("ema"):
        ema = ModelEMA(model, 0.0)
        ema.load_state_dict(state["ema"])
    tensor_keys = ("model", "optimizer", "ema", "checksum")
    save_sharded(dcp_dir, model, optimizer, {k: v for k, v in state.items() if k not in tensor_keys}, ema)


def to_single_file(dcp_dir: str, out_path: str) -> None:
    """Convert a sharded checkpoint to one checksummed file (one process, no process group)."""
    save_checkpoint(read_full_state(dcp_dir), out_path)
