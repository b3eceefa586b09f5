"""Everything one training run holds, built once from the config: TrainState, Run, build_run."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.checkpointing.background_write import BackgroundWriter
from distribuuuu.checkpointing.names import CKPT_DIR
from distribuuuu.config import ConfigError, global_batch
from distribuuuu.data import (
    Split,
    build_batch_mixer,
    build_extra_val_splits,
    build_precise_bn_split,
    build_train_split,
    build_val_split,
    dataset_targets,
    label_counts,
)
from distribuuuu.data.progressive import progressive_on, schedule_sizes, schedule_text, train_size
from distribuuuu.data.samplers import inverse_frequency_weights
from distribuuuu.ema import ModelEMA
from distribuuuu.logger import attach_log_file, get_logger, setup_logging
from distribuuuu.models import build_model, count_parameters, find_blocks, has_batchnorm
from distribuuuu.progress import show_progress_bar
from distribuuuu.records.manifest import record_start
from distribuuuu.records.writer import make_writer
from distribuuuu.runtime.heartbeat import stall_seconds
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import broadcast_parameters, build_mesh, mixed_precision_policy, shard_model
from distribuuuu.runtime.preemption import PreemptionHandler
from distribuuuu.runtime.process_group import check_group, format_rank_table, is_dist, rank0_decides, setup_distributed
from distribuuuu.training.distillation import Teacher, load_teacher
from distribuuuu.training.losses import DistillationLoss, build_criterion, positive_weights
from distribuuuu.training.optim import build_optimizer, freeze, scaled_base_lr
from distribuuuu.training.rng import seed_everything

logger = get_logger("run")


@dataclass
class TrainState:
    """Progress that a checkpoint restores."""

    epoch: int = 0  # completed epochs
    step_in_epoch: int = 0  # optimizer steps done in the epoch in progress
    best_acc1: float = 0.0  # the best checkpoint's val top-1
    best_weights: str = "model"  # which weights reached the best: "model" or "ema"
    best_value: float | None = None  # the best checkpoint's TRAIN.BEST_METRIC (None: no best yet)
    samples_in_epoch: int = 0  # global position in the epoch's permutation: samples all ranks consumed


@dataclass
class Run:
    """Everything one training run holds: built once by build_run, then used by the loops."""

    cfg: CfgNode
    env: DistEnv
    model: nn.Module  # the plain (or, under fsdp/hsdp, sharded) model: what checkpoints hold
    forward_model: nn.Module  # what training calls: compiled and/or DDP-wrapped (or the sharded model)
    eval_model: nn.Module  # what evaluation calls: compiled or plain, never DDP (sharded under fsdp)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    train: Split
    val: Split
    steps_per_epoch: int
    base_lr: float
    writer: object
    ema: ModelEMA | None = None
    mixer: object = None
    extra_val: dict[str, Split] = field(default_factory=dict)  # TEST.EXTRA_DATASETS by split name
    precise_bn: Split | None = None  # BN.PRECISE_IMAGES training images, when set
    teacher: Teacher | None = None  # DISTILL.TEACHER, frozen; then ``criterion`` is a DistillationLoss
    state: TrainState = field(default_factory=TrainState)
    # Further state checkpointed with the run (name -> Stateful: state_dict()/load_state_dict()), for
    # a caller outside the package; the package's own is listed in components.run_components.
    registered_state: dict[str, object] = field(default_factory=dict)
    preempt: PreemptionHandler | None = None
    # TRAIN.CKPT_ASYNC: writes checkpoint files in the background (None: every write blocks training)
    checkpoint_writer: BackgroundWriter | None = None
    checkpoint_group: object = None  # the process group of background DCP writes (state.checkpoint_group)

    @property
    def global_step(self) -> int:
        return self.state.epoch * self.steps_per_epoch + self.state.step_in_epoch

    def at_step(self, epoch: int, step_in_epoch: int) -> TrainState:
        """The state of this run ``step_in_epoch`` steps into ``epoch`` (0-based), on its own global batch."""
        return TrainState(epoch=epoch, step_in_epoch=step_in_epoch, samples_in_epoch=step_in_epoch * self.global_batch)

    def move_to(self, epoch: int, step_in_epoch: int = 0) -> None:
        """Put the run ``step_in_epoch`` steps into ``epoch`` (0-based), its best kept: where the next
        ``train_epoch`` continues (sampler, LR schedule) and what a checkpoint records."""
        best = {k: getattr(self.state, k) for k in ("best_acc1", "best_weights", "best_value")}
        self.state = TrainState(**{**vars(self.at_step(epoch, step_in_epoch)), **best})

    @property
    def global_batch(self) -> int:
        """Samples one optimizer step takes from the epoch's permutation, over all ranks."""
        return global_batch(self.cfg.TRAIN, self.env.world_size)

    @property
    def schedule_step(self) -> float:
        """The LR schedule's position in this run's steps: completed epochs plus the epoch's sample fraction.

        Counted from the global sample position, not from steps: a run resumed with another
        world size (another global batch) lands where the schedule was when it stopped.
        """
        return self.state.epoch * self.steps_per_epoch + self.state.samples_in_epoch / self.global_batch

    @property
    def sharded_checkpoints(self) -> bool:
        return writes_sharded_checkpoints(self.cfg)


def writes_sharded_checkpoints(cfg: CfgNode) -> bool:
    """DIST.CKPT_FORMAT: "" means sharded DCP directories under fsdp/hsdp, single files under ddp."""
    return cfg.DIST.CKPT_FORMAT == "sharded" or (not cfg.DIST.CKPT_FORMAT and cfg.DIST.STRATEGY != "ddp")


def start_process_group(cfg: CfgNode) -> tuple[DistEnv, list[dict]]:
    """Meet the other ranks (fast start-up check), and return where each one runs."""
    d = cfg.DIST
    stall_s = stall_seconds(d.STALL_S, d.TIMEOUT_S)
    env = setup_distributed(d.BACKEND, d.TIMEOUT_S, join_timeout_s=d.INIT_CHECK_TIMEOUT_S, stall_s=stall_s)
    return env, check_group(env, cfg.DIST.INIT_CHECK_TIMEOUT_S)


def prepare_process(cfg: CfgNode, env: DistEnv, table: list[dict], training: bool = True) -> None:
    """Logging (the lines for log.txt kept until ``open_outputs``), seeds and cuDNN: nothing written to OUT_DIR."""
    setup_logging(
        None, env.rank, training and show_progress_bar(cfg.LOG.PROGRESS), console=cfg.LOG.CONSOLE, pending=True
    )
    launch = f"{env.launcher} launch" if env.distributed else "no launcher (a plain process)"
    logger.info("%s, %d process(es):\n%s", launch, env.world_size, format_rank_table(table))
    if cfg.TRAIN.PRECISION == "fp16" and env.device.type == "cpu":
        logger.warning("TRAIN.PRECISION fp16 on the CPU is slow and meant for testing the fp16 path; use bf16")
    seed_everything(cfg.RNG_SEED + env.rank)
    torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK
    torch.backends.cudnn.deterministic = cfg.CUDNN.DETERMINISTIC


def open_outputs(
    cfg: CfgNode, env: DistEnv, table: list[dict], training: bool = True, resumed_from: str | None = None
) -> object:
    """Create OUT_DIR and its log.txt; keep this start's config and manifest; return the metrics writer.

    Called once the inputs proved good: a run stopped by bad input leaves OUT_DIR as it found it.
    An evaluation (``training`` False) writes into OUT_DIR's log and metrics but keeps no config.
    """
    rank0_decides(lambda: _prepare_out_dir(cfg.OUT_DIR, training))  # every rank stops on a bad folder, one prints
    if env.is_main_process:
        attach_log_file(cfg.OUT_DIR)
    if training:
        rank0_decides(lambda: record_start(cfg, env, table, resumed_from))
    return make_writer(cfg.OUT_DIR, env.is_main_process, cfg=cfg if training else None)


def _prepare_out_dir(out_dir: str, training: bool = True) -> None:
    """Create OUT_DIR (and its checkpoints folder) and prove it writable, or raise a ConfigError naming it."""
    try:
        os.makedirs(os.path.join(out_dir, CKPT_DIR) if training else out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"OUT_DIR: cannot write to {out_dir}: {e.strerror or e}") from None


def build_model_for(cfg: CfgNode, env: DistEnv) -> nn.Module:
    """Build the model on this rank's device, with SyncBatchNorm and channels_last as configured."""
    model = build_model(cfg.MODEL)
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


def wrap_model(model: nn.Module, cfg: CfgNode, env: DistEnv) -> nn.Module:
    """torch.compile (optional), then DDP with the configured knobs when there are several ranks."""
    forward = compile_model(model, cfg) if cfg.TRAIN.COMPILE else model
    if env.world_size == 1:
        return forward  # DDP on one rank only costs time (~7% measured here)
    d = cfg.DIST
    ddp = nn.parallel.DistributedDataParallel(
        forward,
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


def log_progressive_schedule(cfg: CfgNode) -> None:
    """Log the training crop of each epoch; warn when the run ends inside the ramp, below TRAIN.IM_SIZE."""
    logger.info("progressive resizing (TRAIN.PROGRESSIVE_*): %s", schedule_text(cfg))
    last = train_size(cfg.OPTIM.MAX_EPOCH - 1, cfg.TRAIN)
    if last != cfg.TRAIN.IM_SIZE:
        logger.warning(
            "TRAIN.PROGRESSIVE_END_EPOCH %d is not below OPTIM.MAX_EPOCH %d: the last epoch trains at %d px, "
            "not TRAIN.IM_SIZE %d", cfg.TRAIN.PROGRESSIVE_END_EPOCH, cfg.OPTIM.MAX_EPOCH, last, cfg.TRAIN.IM_SIZE,
        )  # fmt: skip


def compile_model(model: nn.Module, cfg: CfgNode) -> nn.Module:
    """torch.compile ``model``; under progressive resizing with static shapes, one graph per size.

    A new input size fails the compiled graph's shape guards and recompiles. Left to torch's
    default, the second size recompiles with height and width symbolic ("automatic dynamic
    shapes", as torch._dynamo.mark_dynamic would from the start), and every later epoch, the ones
    at TRAIN.IM_SIZE that hold most of the compute included, runs kernels generic in the size.
    Static shapes instead pay one compile per size, a handful of sizes known from the config, each
    used for whole epochs, and keep every size's kernels specialised, as without the ramp.
    """
    if not progressive_on(cfg.TRAIN):
        return torch.compile(model)
    allow_a_graph_per_size(cfg)
    return torch.compile(model, dynamic=False)


def allow_a_graph_per_size(cfg: CfgNode) -> None:
    """Let dynamo keep as many graphs per function for each size of the schedule as torch's default
    (8) allows for one: past its recompile limit it runs the function eagerly, with one warning."""
    needed = _DYNAMO_DEFAULT_RECOMPILE_LIMIT * len(schedule_sizes(cfg))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)


_DYNAMO_DEFAULT_RECOMPILE_LIMIT = 8


def build_run(cfg: CfgNode, env: DistEnv, writer) -> Run:
    """Build loaders, model, optimizer, scaler, EMA and loss for a training run."""
    train = build_train_split(cfg, env)
    val = build_val_split(cfg, env, train.classes)
    extra_val = build_extra_val_splits(cfg, env, train.classes)
    model = build_model_for(cfg, env)
    teacher = build_teacher(cfg, env, train.classes)  # a bad teacher stops the run here, before training
    freeze_parameters(model, cfg.MODEL.FREEZE)  # before the DDP wrap and the optimizer: both skip them
    t = cfg.TRAIN
    batch = global_batch(t, env.world_size)
    base_lr = scaled_base_lr(cfg.OPTIM, batch)
    steps_per_epoch = len(train.sampler) // global_batch(t)
    logger.info(
        "%s: %.2fM parameters; %d train / %d val images, %d classes; global batch %d "
        "(%d x %d ranks x %d accumulation); %d steps/epoch; base LR %.5g%s",
        cfg.MODEL.ARCH, count_parameters(model) / 1e6, len(train.dataset), len(val.dataset),
        len(train.classes), batch, t.BATCH_SIZE, env.world_size, t.ACCUM_STEPS,
        steps_per_epoch, base_lr,
        f" (OPTIM.BASE_LR x {batch}/{cfg.OPTIM.REFERENCE_BATCH})" if cfg.OPTIM.REFERENCE_BATCH else "",
    )  # fmt: skip
    if progressive_on(t):
        log_progressive_schedule(cfg)
    if shards(cfg, env):
        model, ema = shard_for_training(model, cfg, env)
        forward_model = compiled_or_plain = model  # under TRAIN.COMPILE its blocks are compiled
    else:
        forward_model = wrap_model(model, cfg, env)
        # After the DDP wrap, which broadcasts rank 0's initial weights: every rank's EMA starts from them.
        ema = ModelEMA(model, cfg.OPTIM.EMA_DECAY, cfg.OPTIM.EMA_WARMUP) if cfg.OPTIM.EMA_DECAY > 0 else None
        compiled_or_plain = wrap_model(model, cfg, DistEnv(world_size=1)) if t.COMPILE else model
    return Run(
        cfg=cfg,
        env=env,
        model=model,
        forward_model=forward_model,
        eval_model=compiled_or_plain,
        optimizer=build_optimizer(
            model, cfg.OPTIM, zero=cfg.OPTIM.ZERO and is_dist(), fused=t.PRECISION == "fp16" and not shards(cfg, env)
        ),  # built after sharding: fully_shard replaces the parameters
        scaler=build_scaler(cfg, env),
        criterion=distilled(build_train_criterion(cfg, train), cfg.DISTILL, teacher).to(
            env.device
        ),  # weights: a buffer
        train=train,
        val=val,
        steps_per_epoch=steps_per_epoch,
        base_lr=base_lr,
        writer=writer,
        ema=ema,
        mixer=build_batch_mixer(cfg),
        extra_val=extra_val,
        precise_bn=build_precise_bn_split(cfg, env) if cfg.BN.PRECISE_IMAGES else None,
        teacher=teacher,
        checkpoint_writer=BackgroundWriter() if t.CKPT_ASYNC else None,
    )


def shards(cfg: CfgNode, env: DistEnv) -> bool:
    """DIST.STRATEGY fsdp/hsdp with several ranks (one process trains its plain model)."""
    return cfg.DIST.STRATEGY != "ddp" and env.world_size > 1


def shard_for_training(model: nn.Module, cfg: CfgNode, env: DistEnv) -> tuple[nn.Module, ModelEMA | None]:
    """DIST.STRATEGY fsdp/hsdp: shard ``model`` (blocks, then root) and its EMA copy the same way.

    Rank 0's initial weights are broadcast first (fully_shard does not, DDP does); the EMA copy is
    taken before sharding (sharded modules refuse deepcopy) and sharded alike, so the average
    lives in the same shards as the weights.
    """
    broadcast_parameters(model)
    ema_copy = copy.deepcopy(model) if cfg.OPTIM.EMA_DECAY > 0 else None
    try:
        mesh = build_mesh(cfg.DIST.STRATEGY, env.world_size, env.local_world_size, env.device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    policy = mixed_precision_policy(cfg.TRAIN.PRECISION, model)
    if cfg.TRAIN.COMPILE:
        # Each block compiled in place before sharding (torchtitan's way), with static shapes: the
        # blocks share one forward, and the recompile for another block's shapes would otherwise
        # be dynamic, whose backward Inductor fails to build ("Cannot convert expression to float",
        # torch 2.14 on the CPU; compiling the sharded root fails the same way).
        blocks = find_blocks(model)
        if progressive_on(cfg.TRAIN):
            allow_a_graph_per_size(cfg)
        for block in blocks:
            block.compile(dynamic=False)
        logger.info("TRAIN.COMPILE under %s: %d block(s) compiled", cfg.DIST.STRATEGY, len(blocks))
        if not blocks:
            logger.warning("TRAIN.COMPILE: %s has no repeated blocks to compile: it runs eagerly", cfg.MODEL.ARCH)
    for module in (model, ema_copy):
        if module is not None:
            shard_model(module, mesh, policy, cfg.DIST.RESHARD_AFTER_FORWARD)
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


def build_train_criterion(cfg: CfgNode, train: Split) -> nn.Module:
    """TRAIN.LOSS with label smoothing, the BCE threshold and TRAIN.CLASS_WEIGHTS from the train split."""
    t, weights = cfg.TRAIN, None
    if t.CLASS_WEIGHTS == "balanced":
        try:
            if cfg.MODEL.TASK == "multilabel":  # positive weights: negatives / positives of each class
                found = positive_weights(label_counts(train.dataset, len(train.classes)), len(train.dataset))
            else:
                found = inverse_frequency_weights(dataset_targets(train.dataset), len(train.classes))
        except ValueError as e:
            raise ConfigError(f"TRAIN.CLASS_WEIGHTS balanced: {e}") from None
        # Outputs beyond the dataset's classes (MODEL.NUM_CLASSES larger) never are targets: weight 1.
        weights = torch.ones(cfg.MODEL.NUM_CLASSES)
        weights[: len(found)] = found
        logger.info("TRAIN.CLASS_WEIGHTS balanced: %s", ", ".join(f"{w:.3g}" for w in found.tolist()))
    return build_criterion(t.LOSS, t.LABEL_SMOOTHING, t.BCE_TARGET_THRESHOLD or None, weights, cfg.MODEL.TASK)


def build_teacher(cfg: CfgNode, env: DistEnv, classes: list[str]) -> Teacher | None:
    """DISTILL.TEACHER on this rank's device: replicated, or under DISTILL.SHARD_TEACHER sharded like the student."""
    if not cfg.DISTILL.TEACHER:
        return None
    teacher = load_teacher(cfg, classes, env.device)
    if cfg.DISTILL.SHARD_TEACHER and shards(cfg, env):
        mesh = build_mesh(cfg.DIST.STRATEGY, env.world_size, env.local_world_size, env.device.type)
        shard_model(teacher.module, mesh, None, reshard_after_forward=True)  # fp32 weights, run under autocast
    return teacher


def distilled(criterion: nn.Module, distill_cfg: CfgNode, teacher: Teacher | None) -> nn.Module:
    """The training loss, mixed with the teacher's (DISTILL.ALPHA, TEMPERATURE, HARD) when there is one."""
    if teacher is None:
        return criterion
    return DistillationLoss(criterion, distill_cfg.ALPHA, distill_cfg.TEMPERATURE, distill_cfg.HARD)


def report_finished_run(cfg: CfgNode, env: DistEnv, epochs_done: int) -> None:
    """Say that OUT_DIR's run is finished, on the console only: its log, config and summary stay as they are."""
    setup_logging(None, env.rank)
    if env.is_main_process:
        logger.warning(
            "%s already holds a finished run (%d epochs trained, OPTIM.MAX_EPOCH %d): nothing to train, nothing "
            "written; raise OPTIM.MAX_EPOCH to train on, or give another OUT_DIR to start a new run",
            cfg.OUT_DIR, epochs_done, cfg.OPTIM.MAX_EPOCH,
        )  # fmt: skip
