"""Activation checkpointing under DDP and FSDP2 against the same strategy without it, on 2 ranks.

    torchrun --nproc_per_node=2 tests/scripts/checkpointing_job.py OUT.json

Rank 0 writes, per strategy and mode, the largest difference of weights and BatchNorm statistics after
fsdp_job's training (4 steps of SGD with momentum, 2 micro-batches, clipping) from the run without it.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from fsdp_job import TinyResNet, TinyViT, finish, full, max_diff, train
from torch import nn

from distribuuuu.models import enable_activation_checkpointing, find_blocks
from distribuuuu.runtime.parallel import broadcast_parameters, build_mesh, shard_model

MODES = {"full": ("full", 1), "selective_2": ("selective", 2)}


def trained(plain: nn.Module, strategy: str, mode: tuple[str, int] | None) -> nn.Module:
    """A copy of ``plain`` checkpointed as ``mode`` (None: not at all), wrapped by ``strategy``, trained."""
    model = copy.deepcopy(plain)
    if mode is not None:
        enable_activation_checkpointing(model, *mode)
    if strategy == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = shard_model(model, find_blocks(model), build_mesh("fsdp", dist.get_world_size(), 2), None)
    train(wrapped, accum=2, clip=0.5, ema=None, precision="fp32")
    return model


def buffer_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.buffers(), b.buffers())
    return max(((full(x).double() - full(y).double()).abs().max().item() for x, y in pairs), default=0.0)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for arch in (TinyResNet, TinyViT):
        torch.manual_seed(10 + dist.get_rank())
        plain = arch()
        broadcast_parameters(plain)
        for strategy in ("ddp", "fsdp"):
            reference = trained(plain, strategy, None)
            for name, mode in MODES.items():
                model = trained(plain, strategy, mode)
                key = f"{arch.__name__}/{strategy}/{name}"
                results[key] = {"weights": max_diff(reference, model), "buffers": buffer_diff(reference, model)}
    finish(out_path, results)


if __name__ == "__main__":
    main(sys.argv[1])
