"""FSDP2 sharding for DIST.STRATEGY fsdp and hsdp: the device mesh, the blocks, mixed precision, accumulation.

Also what every strategy's step runs through: autocast, the batch's copy to the device, gradient sync.

``fully_shard`` turns each parameter into a DTensor sharded on dim 0 over the mesh's shard
dimension; every block becomes one all-gather / reduce-scatter unit, so only one block's full
weights live on a rank at a time. The root is sharded last and owns what no block holds (stem,
head). The optimizer must be built *after* ``shard_model``: sharding replaces the parameters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from distribuuuu.runtime.launcher import DistEnv

logger = logging.getLogger(__name__)


def build_mesh(strategy: str, world_size: int, local_world_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh of all ranks for fsdp; (nodes x ranks per node) for hsdp: replicate across, shard within.

    torchrun and Slurm number ranks node by node, so row i of the 2-D mesh is node i: the
    all-gathers and reduce-scatters stay on a node's fast links, and only the gradient all-reduce
    of the replicate dimension crosses nodes.
    """
    if strategy == "fsdp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if strategy == "hsdp":
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(
                f"DIST.STRATEGY hsdp needs the same number of processes on every node: "
                f"world size {world_size} is not a multiple of {local_world_size} per node"
            )
        shape = (world_size // local_world_size, local_world_size)
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    raise ValueError(f"DIST.STRATEGY must be 'fsdp' or 'hsdp' to build a mesh, got {strategy!r}")


def mixed_precision_policy(precision: str, batchnorm: bool) -> MixedPrecisionPolicy | None:
    """bf16/fp16 parameters in forward and backward, fp32 gradient reduction; None for fp32 or BatchNorm.

    Reducing in fp32 keeps the sum over many ranks from losing the small gradients that a 16-bit
    sum rounds away; the sharded fp32 parameters stay the optimizer's master weights. A model
    with BatchNorm gets None: the policy casts BatchNorm's weight to 16 bits but not its running
    statistics, and batch_norm then fails ("expected scalar type BFloat16 but found Float", torch
    2.14 on the CPU). Such a model (``batchnorm``) keeps fp32 parameters and autocast, which the
    trainer keeps on under every strategy, runs its convolutions in 16 bits and BatchNorm in fp32,
    as under DDP.
    """
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"TRAIN.PRECISION must be fp32, bf16 or fp16, got {precision!r}")
    if precision == "fp32" or batchnorm:
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply ``fully_shard`` to each of ``blocks`` (``models.find_blocks``: in forward order), then to
    the root ``model``; return the model (now an FSDPModule).

    ``reshard_after_forward`` frees each block's gathered weights after its forward (ZeRO-3: least
    memory, one more all-gather in backward); False keeps them to backward (ZeRO-2-like). The last
    block is never resharded: backward needs it at once, so freeing it would only add an all-gather.
    """
    if not blocks:
        logger.warning("%s: no repeated blocks found: sharding the whole model as one unit", type(model).__name__)
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True if ``model`` (or the module torch.compile wraps) was sharded by ``fully_shard``."""
    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Under FSDP2, reduce-scatter gradients in the coming backward only if ``sync`` (a no-op otherwise).

    Call before each micro-batch's backward with ``sync`` True on the last one. FSDP2 reads the
    flag in backward, not in forward as DDP's ``no_sync`` does, so it is a setter, not a context
    around the forward. Skipping keeps unsharded gradients of every block until the last
    micro-batch: less communication, more memory (one full gradient copy) during accumulation.
    """
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def norm_value(norm: torch.Tensor | None) -> torch.Tensor | None:
    """``clip_grad_norm_``'s result as a plain tensor: under FSDP2 it is a DTensor (the same on every rank)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(states),
    }


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Give every rank ``src``'s parameters and buffers; call before ``shard_model``.

    DDP does this when it wraps a model; ``fully_shard`` does not: each rank keeps its slice of
    its *own* initial weights, so ranks seeded differently would assemble a mixed model.
    """
    if dist.is_available() and dist.is_initialized():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src)


def missing_forwards(num_local_batches: int, device: torch.device) -> int:
    """How many empty forwards this rank owes so every rank calls a sharded model equally often.

    Each forward of a sharded model all-gathers with every rank, and the exact eval sampler
    gives ranks up to one batch more or less: the ranks with fewer batches run ``model(x[:0])``
    this many times after their last one, or the others wait for them forever. Call it *before*
    the loop: its all-reduce, called after a rank's last batch, would meet the all-gather of a
    peer's extra batch and deadlock.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    box = torch.tensor([num_local_batches], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item()) - num_local_batches


def autocast(run_or_cfg_precision: str, device: torch.device):
    """Autocast context for TRAIN.PRECISION (a no-op for fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run_or_cfg_precision)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def to_device(images: torch.Tensor, targets: torch.Tensor, env: DistEnv, channels_last: bool):
    """Copy a batch to the device (asynchronously from pinned memory on CUDA)."""
    images = images.to(env.device, non_blocking=True)
    targets = targets.to(env.device, non_blocking=True)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, targets


def gradient_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) on micro-batches other than the last."""
    set_gradient_sync(model, sync)  # FSDP2 reads its flag in backward: a setter, before the forward is fine
    ddp = getattr(model, "_orig_mod", model)  # compiled after the DDP wrap: torch.compile's module holds it
    if sync or not isinstance(ddp, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return ddp.no_sync()
