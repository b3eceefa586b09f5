"""How a run's model is spread over the ranks and compiled: built on the device, frozen as asked,
then DDP-wrapped (and compiled), or sharded by FSDP2 over one mesh (fsdp, hsdp); the loss scaler to
match. ``shards`` is the one predicate of whether the model is sharded."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from yacs.config import CfgNode

from distribuuuu.config import ConfigError, parse_model_kwargs
from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger
from distribuuuu.models import NotFetched, build_model, find_blocks, has_batchnorm
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import broadcast_parameters, build_mesh, mixed_precision_policy, shard_model
from distribuuuu.runtime.process_group import broadcast_buffers
from distribuuuu.training.class_count import LEGACY_CLASSES
from distribuuuu.training.ema import ModelEMA
from distribuuuu.training.optim import freeze
from distribuuuu.training.preprocessing import progressive

logger = get_logger("run")


@dataclass
class Parallel:
    """A model as training uses it: what checkpoints hold, what training and evaluation call, its EMA
    copy (sharded alike), and the mesh it is sharded over (None: replicated by DDP, or one process)."""

    model: nn.Module
    forward_model: nn.Module
    eval_model: nn.Module
    ema: ModelEMA | None
    mesh: DeviceMesh | None = None


def parallelize(model: nn.Module, cfg: CfgNode, env: DistEnv) -> Parallel:
    """Shard ``model`` (fsdp/hsdp on several ranks), else DDP-wrap and compile it as configured."""
    if shards(cfg, env):
        mesh = training_mesh(cfg, env)
        model, ema = shard_for_training(model, cfg, env, mesh)
        return Parallel(model, model, model, ema, mesh)  # under TRAIN.COMPILE its blocks are compiled
    forward_model = wrap_model(model, cfg, env)
    # After the DDP wrap, which broadcasts rank 0's initial weights: every rank's EMA starts from them.
    ema = ModelEMA(model, cfg.OPTIM.EMA_DECAY, cfg.OPTIM.EMA_WARMUP) if cfg.OPTIM.EMA_DECAY > 0 else None
    eval_model = wrap_model(model, cfg, DistEnv(world_size=1)) if cfg.TRAIN.COMPILE else model
    return Parallel(model, forward_model, eval_model, ema)


def training_mesh(cfg: CfgNode, env: DistEnv) -> DeviceMesh:
    """The one device mesh of DIST.STRATEGY fsdp (all ranks) or hsdp (nodes x ranks per node)."""
    try:
        return build_mesh(cfg.DIST.STRATEGY, env.world_size, env.local_world_size, env.device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_configured_model(model_cfg: CfgNode) -> nn.Module:
    """MODEL.ARCH with MODEL.NUM_CLASSES outputs, MODEL.KWARGS, its pretrained weights (MODEL.PRETRAINED_WEIGHTS,
    or the default ones for MODEL.PRETRAINED), MODEL.ZERO_INIT_RESIDUAL and MODEL.ACTIVATION_CHECKPOINTING.

    A run's config has its class count decided (``build_run``: the data's, for MODEL.NUM_CLASSES 0);
    a model built from a config alone, with no data read, keeps the former default's 10 outputs."""
    m = model_cfg
    weights = m.PRETRAINED_WEIGHTS or ("DEFAULT" if m.PRETRAINED else None)
    kwargs, outputs = parse_model_kwargs(m.KWARGS), m.NUM_CLASSES or LEGACY_CLASSES
    checkpointing = activation_checkpointing(m)
    try:
        return build_model(m.ARCH, outputs, kwargs, weights, m.ZERO_INIT_RESIDUAL, *checkpointing)
    except TypeError as e:  # a keyword the constructor does not take
        raise ConfigError(f"MODEL.KWARGS {m.KWARGS}: {m.ARCH} refuses them ({first_line(e)})") from None
    except NotFetched as e:  # named by the key the user set: MODEL.PRETRAINED_WEIGHTS wins over MODEL.PRETRAINED
        key, off = ("MODEL.PRETRAINED_WEIGHTS", "''") if m.PRETRAINED_WEIGHTS else ("MODEL.PRETRAINED", "False")
        raise ConfigError(f"{key}: {e} or set {key} {off}") from None


def activation_checkpointing(model_cfg: CfgNode) -> tuple[str, int]:
    """MODEL.ACTIVATION_CHECKPOINTING and its period (MODEL.ACTIVATION_CHECKPOINTING_EVERY under
    selective, 1 otherwise); MODEL.GRAD_CHECKPOINT True, the original key, is "full"."""
    mode = model_cfg.ACTIVATION_CHECKPOINTING
    if model_cfg.GRAD_CHECKPOINT and mode == "none":
        mode = "full"
    return mode, model_cfg.ACTIVATION_CHECKPOINTING_EVERY if mode == "selective" else 1


def build_model_for(cfg: CfgNode, env: DistEnv) -> nn.Module:
    """Build the model on this rank's device, with SyncBatchNorm and channels_last as configured."""
    model = build_configured_model(cfg.MODEL)
    if cfg.MODEL.SYNCBN and has_batchnorm(model):
        if env.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif env.world_size > 1:
            logger.warning(
                "MODEL.SYNCBN ignored: PyTorch's SyncBatchNorm runs on CUDA only; on the CPU each "
                "process keeps its own BatchNorm batch statistics (running stats follow rank 0)"
            )
    model = model.to(env.device)
    if cfg.TRAIN.CHANNELS_LAST and shards(cfg, env):
        # FSDP2 refuses non-contiguous parameters (torch 2.14): the weights stay contiguous and
        # the channels_last inputs alone pick the convolutions' memory format.
        logger.info(
            "TRAIN.CHANNELS_LAST under DIST.STRATEGY %s: channels_last inputs, contiguous weights", cfg.DIST.STRATEGY
        )
    elif cfg.TRAIN.CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    return model


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Freeze MODEL.FREEZE's parameters and log their names; a pattern matching nothing is a ConfigError."""
    if not patterns:
        return []
    try:
        frozen = freeze(model, patterns)
    except ValueError as e:
        raise ConfigError(f"MODEL.FREEZE: {e}") from None
    logger.info("MODEL.FREEZE: %d parameter tensor(s) frozen: %s", len(frozen), ", ".join(frozen))
    return frozen


def shards(cfg: CfgNode, env: DistEnv) -> bool:
    """DIST.STRATEGY fsdp/hsdp with several ranks (one process trains its plain model)."""
    return cfg.DIST.STRATEGY != "ddp" and env.world_size > 1


def wrap_model(model: nn.Module, cfg: CfgNode, env: DistEnv) -> nn.Module:
    """DDP with the configured knobs when there are several ranks, then torch.compile (optional).

    Compiled after the wrap, as DDP's documentation asks: dynamo then cuts the graph at DDP's
    bucket boundaries (its DDPOptimizer), so the backward is one compiled piece per bucket and
    each bucket's all-reduce starts when its piece is done, overlapping the pieces still to run. A
    backward compiled whole hands DDP every gradient at its end, and every all-reduce waits for it.
    (tests/integration/test_levers.py shows the pieces and the all-reduces between them on 2 ranks.)
    DIST.COMM_HOOK bf16 (or fp16) all-reduces the gradients in 16 bits: half the bytes on the wire.
    """
    wrapped = model if env.world_size == 1 else ddp_wrap(model, cfg.DIST, env)  # one rank: DDP only costs (~7%)
    return compile_model(wrapped, cfg) if cfg.TRAIN.COMPILE else wrapped


def ddp_wrap(model: nn.Module, dist_cfg: CfgNode, env: DistEnv) -> nn.parallel.DistributedDataParallel:
    """DDP with DIST's bucket size, bucket views, static graph, unused parameters and gradient hook."""
    d = dist_cfg
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=d.BUCKET_CAP_MB,
        gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
        static_graph=d.STATIC_GRAPH,
        find_unused_parameters=d.FIND_UNUSED_PARAMETERS,
    )
    if d.COMM_HOOK:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if d.COMM_HOOK == "fp16" else default_hooks.bf16_compress_hook
        ddp.register_comm_hook(None, hook)
    return ddp


def compile_model(model: nn.Module, cfg: CfgNode) -> nn.Module:
    """torch.compile ``model``; under progressive resizing with static shapes, one graph per size.

    A new input size fails the compiled graph's shape guards and recompiles. Left to torch's
    default, the second size recompiles with height and width symbolic ("automatic dynamic
    shapes", as torch._dynamo.mark_dynamic would from the start), and every later epoch, the ones
    at TRAIN.IM_SIZE that hold most of the compute included, runs kernels generic in the size.
    Static shapes instead pay one compile per size, a handful of sizes known from the config, each
    used for whole epochs, and keep every size's kernels specialised, as without the ramp.
    """
    if not progressive(cfg).on:
        return torch.compile(model)
    allow_a_graph_per_size(cfg)
    return torch.compile(model, dynamic=False)


def allow_a_graph_per_size(cfg: CfgNode) -> None:
    """Let dynamo keep as many graphs per function for each size of the schedule as torch's default
    (8) allows for one: past its recompile limit it runs the function eagerly, with one warning."""
    needed = _DYNAMO_DEFAULT_RECOMPILE_LIMIT * len(progressive(cfg).sizes())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)


_DYNAMO_DEFAULT_RECOMPILE_LIMIT = 8


def shard_for_training(
    model: nn.Module, cfg: CfgNode, env: DistEnv, mesh: DeviceMesh
) -> tuple[nn.Module, ModelEMA | None]:
    """DIST.STRATEGY fsdp/hsdp: shard ``model`` (blocks, then root) over ``mesh``, and its EMA copy the same way.

    Rank 0's initial weights are broadcast first (fully_shard does not, DDP does); the EMA copy is
    taken before sharding (sharded modules refuse deepcopy) and sharded alike, so the average
    lives in the same shards as the weights.
    """
    broadcast_parameters(model)
    ema_copy = copy.deepcopy(model) if cfg.OPTIM.EMA_DECAY > 0 else None
    policy = mixed_precision_policy(cfg.TRAIN.PRECISION, has_batchnorm(model))
    if cfg.TRAIN.COMPILE:
        # Each block compiled in place before sharding (torchtitan's way), with static shapes: the
        # blocks share one forward, and the recompile for another block's shapes would otherwise
        # be dynamic, whose backward Inductor fails to build ("Cannot convert expression to float",
        # torch 2.14 on the CPU; compiling the sharded root fails the same way).
        blocks = find_blocks(model)
        if progressive(cfg).on:
            allow_a_graph_per_size(cfg)
        for block in blocks:
            block.compile(dynamic=False)
        logger.info("TRAIN.COMPILE under %s: %d block(s) compiled", cfg.DIST.STRATEGY, len(blocks))
        if not blocks:
            logger.warning("TRAIN.COMPILE: %s has no repeated blocks to compile: it runs eagerly", cfg.MODEL.ARCH)
    for module in (model, ema_copy):
        if module is not None:
            shard_model(module, find_blocks(module), mesh, policy, cfg.DIST.RESHARD_AFTER_FORWARD)
    logger.info(
        "DIST.STRATEGY %s: mesh %s, parameters %s in forward, reshard after forward %s",
        cfg.DIST.STRATEGY, tuple(mesh.shape), policy.param_dtype if policy else "fp32 (autocast)",
        cfg.DIST.RESHARD_AFTER_FORWARD,
    )  # fmt: skip
    ema = ModelEMA.owning(ema_copy, cfg.OPTIM.EMA_DECAY, cfg.OPTIM.EMA_WARMUP) if ema_copy is not None else None
    return model, ema


def build_scaler(cfg: CfgNode, env: DistEnv) -> torch.amp.GradScaler:
    """fp16's loss scaler; under fsdp/hsdp the sharded one, which agrees on a non-finite shard over ranks."""
    enabled = cfg.TRAIN.PRECISION == "fp16"
    if shards(cfg, env):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(env.device.type, enabled=enabled)
    return torch.amp.GradScaler(env.device.type, enabled=enabled)


def agree_on_buffers(model: nn.Module, ema: ModelEMA | None) -> None:
    """Give every rank rank 0's BatchNorm statistics (raw and EMA), so all evaluate what is saved.

    DDP broadcasts rank 0's buffers before each forward, and the forward then updates each rank's
    running statistics from its own batch: after an epoch's last step they differ across ranks
    (SyncBatchNorm aside), and a rank validating its shard would score other weights than the
    checkpoint holds. Once per epoch, before evaluation and the checkpoint.
    """
    broadcast_buffers(model)
    if ema is not None:
        broadcast_buffers(ema.module)
