"""OPTIM.OPTIMIZER muon under FSDP2 against the same optimizer on the replicated model, fed the same gradients.

    torchrun --nproc_per_node=2 tests/scripts/muon_fsdp_job.py OUT.json

Rank 0 writes the largest weight differences after three steps (Muon's matrices, AdamW's rest), and what orthogonalising each rank's
shard alone would have moved a weight by in one step; tests/integration/test_muon_runs.py holds the bound.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from fsdp_job import TinyViT, finish, full
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from distribuuuu.config import load_cfg
from distribuuuu.models import find_blocks
from distribuuuu.runtime.parallel import broadcast_parameters, build_mesh, shard_model
from distribuuuu.training.optim import build_optimizer, set_lr

STEPS, LR = 3, 0.01
NS = ((3.4445, -4.775, 2.0315), 5, 1e-7)  # torch's Newton-Schulz coefficients, steps, eps


def gradients(step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradient of every parameter: the same full-rank random matrices on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def train(model: nn.Module) -> tuple[torch.optim.Optimizer, dict]:
    """STEPS steps of Muon (with AdamW) on ``model``'s parameters, fed the same gradients whether it is
    sharded or not (a sharded parameter gets its shard): the optimizer alone is compared. Returns the
    optimizer and the first step's gradients."""
    optimizer = build_optimizer(model, load_cfg(None, ["OPTIM.OPTIMIZER", "muon"]).OPTIM)
    set_lr(optimizer, LR)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            grad = gradients(step, model)[name]
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer, gradients(0, model)


def per_shard_update(optimizer: torch.optim.Optimizer, module: nn.Module, grads: dict) -> float:
    """How far a Muon that orthogonalised each rank's rows alone would move a weight in the first step."""
    names, worst = {id(p): n for n, p in module.named_parameters()}, 0.0
    for group in optimizer.param_groups:
        for p in group["params"] if group["muon"] else []:
            g = grads[names[id(p)]]
            whole = _zeropower_via_newtonschulz(g, *NS).float()
            halves = torch.cat([_zeropower_via_newtonschulz(h, *NS).float() for h in g.chunk(2)])
            worst = max(worst, LR * 0.2 * max(g.shape) ** 0.5 * (whole - halves).abs().max().item())
    return worst


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(10 + dist.get_rank())  # ranks start differently: the broadcast fixes it
    plain = TinyViT()
    broadcast_parameters(plain)
    replicated, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
    shard_model(sharded, find_blocks(sharded), build_mesh("fsdp", dist.get_world_size(), 2), None)
    replicated_optimizer, grads = train(replicated)
    fsdp_optimizer, _ = train(sharded)
    muon = {id(p) for g in replicated_optimizer.param_groups if g["muon"] for p in g["params"]}
    differences = {
        id(q): (full(p).detach() - q.detach()).abs().max().item()
        for p, q in zip(sharded.parameters(), replicated.parameters())
    }
    result = {
        "weights": max(d for i, d in differences.items() if i in muon),
        "adamw_weights": max(d for i, d in differences.items() if i not in muon),
        "per_shard_weights": per_shard_update(replicated_optimizer, replicated, grads),
        "muon_matrices": sum(len(g["params"]) for g in fsdp_optimizer.param_groups if g["muon"]),
        "sharded": all(hasattr(p, "full_tensor") for g in fsdp_optimizer.param_groups for p in g["params"]),
        "max_dim": max(max(p.shape) for g in replicated_optimizer.param_groups if g["muon"] for p in g["params"]),
    }
    finish(out_path, result)


if __name__ == "__main__":
    main(sys.argv[1])
