"""FSDP2 against DDP, several scenarios in one torchrun job (start-up is the expensive part).

    torchrun --nproc_per_node=2 tests/scripts/fsdp_job.py OUT.json fsdp
    torchrun --nproc_per_node=4 tests/scripts/fsdp_job.py OUT.json hsdp

Rank 0 writes the measured differences and byte counts to OUT.json; the test holds the tolerances.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torchvision.models.resnet import BasicBlock

from distribuuuu.models import find_blocks, has_batchnorm
from distribuuuu.runtime.parallel import (
    broadcast_parameters,
    build_mesh,
    local_state_bytes,
    mixed_precision_policy,
    norm_value,
    set_gradient_sync,
    shard_model,
)
from distribuuuu.training.ema import ModelEMA

STEPS, GLOBAL_BATCH, IM = 4, 8, 8


class TinyResNet(nn.Module):
    """torchvision's BasicBlock in ``layerN`` stages, 16 channels wide: the ResNet shape, tiny."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        down = nn.Sequential(nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width))
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2, down), BasicBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.conv1(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TinyViT(nn.Module):
    """A patch embedding, transformer layers in ``blocks`` (timm's name), LayerNorm: no BatchNorm."""

    def __init__(self, dim: int = 32, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.Sequential(*[copy.deepcopy(layer) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.patch(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch: the same global batches for every strategy."""
    g = torch.Generator().manual_seed(1000 + step)
    images, targets = (
        torch.randn(GLOBAL_BATCH, 3, IM, IM, generator=g),
        torch.randint(0, 10, (GLOBAL_BATCH,), generator=g),
    )
    per_rank = GLOBAL_BATCH // world
    return images[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]


def train(model: nn.Module, accum: int, clip: float, ema: ModelEMA | None, precision: str) -> dict:
    """SGD with momentum for STEPS steps (under autocast for bf16); return the gradient norms and the optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    norms = []
    for step in range(STEPS):
        images, targets = batch(step, rank, world)
        for i, (x, y) in enumerate(zip(images.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            set_gradient_sync(model, last)  # FSDP2: no reduce-scatter before the last micro-batch
            ddp_skip = isinstance(model, nn.parallel.DistributedDataParallel) and not last
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
            with model.no_sync() if ddp_skip else contextlib.nullcontext(), autocast:
                loss = nn.functional.cross_entropy(model(x).float(), y)
                (loss / accum).backward()
        if clip > 0:
            norms.append(float(norm_value(nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True))))
        optimizer.step()
        if ema is not None:
            ema.update(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)
        if step < STEPS - 1:  # keep the last gradients for the byte count
            optimizer.zero_grad(set_to_none=True)
    return {"norms": norms, "optimizer": optimizer}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between two models' parameters (sharded ones gathered)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return max((full(pa[k]).detach() - full(pb[k]).detach()).abs().max().item() for k in pa)


def sharded_copy(model: nn.Module, mesh, policy) -> nn.Module:
    """A copy of ``model``, its blocks sharded over ``mesh``, then its root."""
    copied = copy.deepcopy(model)
    return shard_model(copied, find_blocks(copied), mesh, policy)


def compare(strategy: str, accum: int, clip: float, precision: str = "fp32", arch: type = TinyResNet) -> dict:
    """Train DDP and FSDP (or HSDP) copies of one model on the same batches; return the differences."""
    torch.manual_seed(rank_seed := 10 + dist.get_rank())  # ranks start differently: the broadcast fixes it
    plain = arch()
    broadcast_parameters(plain)
    ddp_model = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    ddp_ema = ModelEMA(ddp_model.module, 0.9)
    mesh = build_mesh(strategy, dist.get_world_size(), 2)
    policy = mixed_precision_policy(precision, has_batchnorm(plain))
    fsdp_ema = ModelEMA.owning(sharded_copy(plain, mesh, policy), 0.9)
    fsdp_model = sharded_copy(plain, mesh, policy)
    ddp = train(ddp_model, accum, clip, ddp_ema, precision)
    fsdp = train(fsdp_model, accum, clip, fsdp_ema, precision)
    reference = {}
    if precision != "fp32":  # how far 16-bit rounding alone moves DDP's run: the scale of FSDP's gap
        fp32_model = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
        fp32 = train(fp32_model, accum, clip, None, "fp32")
        reference = {
            "weights_vs_fp32": max_diff(ddp_model.module, fp32_model.module),
            "fsdp_vs_fp32": max_diff(fsdp_model, fp32_model.module),
            "norms_fp32": fp32["norms"],
        }
    return {
        "seed": rank_seed,
        "weights": max_diff(ddp_model.module, fsdp_model),
        "ema": max_diff(ddp_ema.module, fsdp_ema.module),
        "norms_ddp": ddp["norms"],
        "norms_fsdp": fsdp["norms"],
        "bytes_ddp": local_state_bytes(ddp_model, ddp["optimizer"]),
        "bytes_fsdp": local_state_bytes(fsdp_model, fsdp["optimizer"]),
        "param_dtype": str(next(fsdp_model.parameters()).dtype),
        **reference,
    }


def main(out_path: str, strategy: str) -> None:
    dist.init_process_group("gloo")
    scenarios = {
        "plain": dict(accum=1, clip=0.0),
        "accum_clip": dict(accum=2, clip=0.5),
        "bf16_accum_clip": dict(accum=2, clip=0.5, precision="bf16"),
        "vit_bf16_params": dict(accum=2, clip=0.5, precision="bf16", arch=TinyViT),
    }
    if strategy == "hsdp":  # 4 processes on a few cores: the one scenario that covers most
        scenarios = {"bf16_accum_clip": scenarios["bf16_accum_clip"], "accum_clip": scenarios["accum_clip"]}
    results = {name: compare(strategy, **kw) for name, kw in scenarios.items()}
    results["world_size"] = dist.get_world_size()
    finish(out_path, results)


def finish(out_path: str, results: dict) -> None:
    """Rank 0 writes ``results`` to ``out_path``; every rank waits for it, then ends the group."""
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
