"""The multi-GPU levers against the plain DDP run, in one 2-rank gloo job (start-up is the expensive
part): TRAIN.COMPILE compiled after the DDP wrap (the backward in pieces, buckets all-reduced
between them), gradient accumulation under it, fused SGD under bf16, DIST.COMM_HOOK bf16.

    torchrun --nproc_per_node=2 tests/scripts/levers_job.py OUT.json

The runs go through the trainer's own pieces (parallelize.wrap_model, run.fused_step,
optim.build_optimizer, runtime.parallel.gradient_sync and autocast). Rank 0 writes each scenario's
difference from its reference, the order of the last step's compiled backward pieces and bucket
all-reduces, and the bucket counts to OUT.json; the test holds the bounds.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from fsdp_job import batch  # the same global batches, 8 of 8x8 pixels, sliced by rank
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from distribuuuu.config import load_cfg
from distribuuuu.runtime.parallel import autocast, gradient_sync
from distribuuuu.runtime.process_group import setup_distributed
from distribuuuu.training.optim import build_optimizer
from distribuuuu.training.parallelize import compile_model, ddp_wrap, wrap_model
from distribuuuu.training.run import fused_step

STEPS, WIDTH = 3, 128


class LeversNet(nn.Module):
    """Three 128-channel conv-BN-ReLU layers (590 KB of weights each): DDP buckets of 1 MB hold about
    two, so the backward has several buckets to all-reduce."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU())
        layers = [
            (nn.Conv2d(WIDTH, WIDTH, 3, padding=1, bias=False), nn.BatchNorm2d(WIDTH), nn.ReLU()) for _ in range(3)
        ]
        self.body = nn.Sequential(*[module for layer in layers for module in layer])
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def compiled_then_wrapped(model: nn.Module, cfg, env) -> nn.Module:
    """The order before: torch.compile, then DDP around the compiled module."""
    return ddp_wrap(compile_model(model, cfg), cfg.DIST, env)


def watch_pieces(loss: torch.Tensor, log: list) -> None:
    """Log "piece" each time one of the loss's compiled backward functions has run."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            node.register_hook(lambda grad_inputs, grad_outputs: log.append("piece"))
        stack += [parent for parent, _ in node.next_functions]


def train(env, *opts: str, wrap=wrap_model, fused: bool | None = None, accum: int = 1) -> dict:
    """STEPS optimizer steps of LeversNet as the trainer wraps and steps it; the weights, the last
    step's order of backward pieces and bucket all-reduces, and the buckets a step."""
    cfg = load_cfg(None, ["DIST.BUCKET_CAP_MB", "1", "OPTIM.BASE_LR", "0.1", *opts])
    torch._dynamo.reset()  # each scenario compiles its own graphs
    torch.manual_seed(10 + env.rank)  # ranks start differently: DDP's broadcast makes them agree
    model = LeversNet()
    forward = wrap(model, cfg, env)
    log, grad_max = [], []

    def recording(state, bucket):
        log.append("bucket")
        grad_max.append(bucket.buffer().abs().max().item())  # this rank's gradient, before the average
        return default_hooks.allreduce_hook(None, bucket)

    if not cfg.DIST.COMM_HOOK:
        getattr(forward, "_orig_mod", forward).register_comm_hook(None, recording)
    optimizer = build_optimizer(model, cfg.OPTIM, fused=fused_step(cfg, env) if fused is None else fused)
    buckets, largest = [], []
    for step in range(STEPS):
        log.clear(), grad_max.clear()
        images, targets = batch(step, env.rank, env.world_size)
        for i, (x, y) in enumerate(zip(images.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            with gradient_sync(forward, last), autocast(cfg.TRAIN.PRECISION, env.device):
                loss = nn.functional.cross_entropy(forward(x).float(), y)
            if last:
                watch_pieces(loss, log)
            (loss / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        buckets.append(log.count("bucket"))
        largest.append(max(grad_max, default=0.0))
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "order": list(log),
        "buckets": buckets,
        "grad_max": largest,
        "fused": bool(optimizer.param_groups[0].get("fused")),
        "lr": cfg.OPTIM.BASE_LR,
        "momentum": cfg.OPTIM.MOMENTUM,
    }


def relative_difference(a: dict, b: dict) -> float:
    """The largest difference of two runs' weights, each tensor's relative to its largest value."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a["weights"], b["weights"]))


def largest_difference(a: dict, b: dict) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a["weights"], b["weights"]))


def main(out_path: str) -> None:
    env = setup_distributed("gloo")
    compiled = ("TRAIN.COMPILE", "True")
    runs = {
        "eager": train(env),
        "compiled": train(env, *compiled),
        "compiled_before_wrap": train(env, *compiled, wrap=compiled_then_wrapped),
        "eager_accum": train(env, accum=2),
        "compiled_accum": train(env, *compiled, accum=2),
        "bf16_fused": train(env, "TRAIN.PRECISION", "bf16"),
        "bf16_foreach": train(env, "TRAIN.PRECISION", "bf16", fused=False),
        "bf16_comm_hook": train(env, "DIST.COMM_HOOK", "bf16"),
    }
    # The gradient bound of the bf16 hook: the largest local gradient of each step, over the ranks.
    grad_max = torch.tensor(runs["eager"]["grad_max"])
    dist.all_reduce(grad_max, op=dist.ReduceOp.MAX)
    pairs = {
        "compiled": "eager",
        "compiled_before_wrap": "compiled",
        "compiled_accum": "eager_accum",
        "bf16_fused": "bf16_foreach",
        "bf16_foreach": "eager",
        "bf16_comm_hook": "eager",
    }
    results = {
        name: {
            "vs": pairs.get(name),
            "relative": relative_difference(run, runs[pairs[name]]) if name in pairs else 0.0,
            "largest": largest_difference(run, runs[pairs[name]]) if name in pairs else 0.0,
            **{k: run[k] for k in ("order", "buckets", "fused", "lr", "momentum")},
        }
        for name, run in runs.items()
    }
    results["eager"]["grad_max"] = grad_max.tolist()
    results["world_size"] = env.world_size
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
