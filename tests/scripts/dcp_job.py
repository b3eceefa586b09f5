"""Sharded checkpoints across world sizes, run under torchrun by tests/test_sharded_checkpoint.py.

    torchrun --nproc_per_node=2 tests/scripts/dcp_job.py OUT save   # train 2 steps, save, write the reference
    torchrun --nproc_per_node=3 tests/scripts/dcp_job.py OUT load   # load into 3 shards, write what it holds

The reference and the loaded state are full tensors gathered by the test's own code (StateDictOptions
full_state_dict): the checkpoint code itself never gathers.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from fsdp_job import TinyResNet, train  # tests/scripts is the script's directory
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from distribuuuu.checkpointing.sharded import load_states, save_sharded, tensor_states
from distribuuuu.ema import ModelEMA
from distribuuuu.runtime.parallel import build_mesh, shard_model
from distribuuuu.runtime.process_group import all_gather_object

NAME = "ckpt_ep_001_it_000004.dcp"


def _load(path: str, model, optimizer, ema) -> dict:
    """``path`` into model, optimizer and EMA shards (collective), the EMA's update count from its extra state."""
    extra = load_states(path, tensor_states(model, optimizer, ema))
    ema.updates = int(extra["ema_updates"])
    return extra


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: ModelEMA) -> dict:
    """Every tensor of the training state, gathered in full (a test-only reference)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    ema_state = get_state_dict(ema.module, [], options=options)[0]
    return {"model": model_state, "optimizer": optim_state, "ema": ema_state, "ema_updates": ema.updates}


def sharded_run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, ModelEMA]:
    torch.manual_seed(seed)
    plain = TinyResNet()
    mesh = build_mesh("fsdp", dist.get_world_size(), dist.get_world_size())
    ema = ModelEMA.owning(shard_model(copy.deepcopy(plain), mesh, None), 0.9)
    model = shard_model(plain, mesh, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return model, optimizer, ema


def main(out_dir: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "save":
        model, _, ema = sharded_run(seed=0)
        optimizer = train(model, accum=1, clip=0.0, ema=ema, precision="fp32")["optimizer"]
        extra = {"epoch": 0, "step_in_epoch": 4, "world_size": world, "rng": all_gather_object(torch.get_rng_state())}
        save_sharded(f"{out_dir}/{NAME}", model, optimizer, extra, ema)
        result = full_state(model, optimizer, ema)
    else:
        model, optimizer, ema = sharded_run(seed=1)  # other initial weights: the load must replace them
        extra = _load(f"{out_dir}/{NAME}", model, optimizer, ema)
        result = dict(full_state(model, optimizer, ema), extra=extra)
    if rank == 0:
        torch.save(result, f"{out_dir}/{mode}_{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
