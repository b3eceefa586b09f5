"""A training run assembled from the config, once: ``build_run`` (data, model, optimizer, task, loss)."""

from __future__ import annotations

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError
from distribuuuu.data import Split
from distribuuuu.logger import get_logger
from distribuuuu.losses import DistillationLoss
from distribuuuu.models import count_parameters, find_blocks
from distribuuuu.models.flops import TRAINING_FLOPS_PER_FORWARD, forward_flops
from distribuuuu.records.telemetry import Telemetry
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import shard_model
from distribuuuu.runtime.process_group import is_dist
from distribuuuu.training.class_count import take_class_count
from distribuuuu.training.distillation import Teacher, load_teacher
from distribuuuu.training.inputs import (
    build_extra_val_splits,
    build_precise_bn_split,
    build_train_split,
    build_val_split,
    train_data,
    train_location,
)
from distribuuuu.training.optim import build_optimizer, scaled_base_lr
from distribuuuu.training.parallelize import (
    build_model_for,
    build_scaler,
    freeze_parameters,
    parallelize,
    shards,
)
from distribuuuu.training.preprocessing import build_batch_mixer, progressive
from distribuuuu.training.state import Best, Run, global_batch
from distribuuuu.training.task import Task, build_task

logger = get_logger("run")


def build_run(cfg: CfgNode, env: DistEnv) -> Run:
    """Build loaders, model, optimizer, scaler, EMA, task and loss for a training run; its ``cfg`` is
    ``cfg`` with MODEL.NUM_CLASSES 0 resolved to the training data's class count (class_count.py)."""
    data = train_data(cfg, env)  # read once: its classes decide a count left to the data
    cfg = take_class_count(cfg, len(data[1]), train_location(cfg))
    task = build_task(cfg.MODEL, cfg.TEST)
    train = build_train_split(cfg, env, data)
    val = build_val_split(cfg, env, train.classes)
    extra_val = build_extra_val_splits(cfg, env, train.classes)
    model = build_model_for(cfg, env)
    teacher = load_teacher(cfg, train.classes, env.device) if cfg.DISTILL.TEACHER else None  # a bad one stops here
    freeze_parameters(model, cfg.MODEL.FREEZE)  # before the DDP wrap and the optimizer: both skip them
    batch = global_batch(cfg.TRAIN, env.world_size)
    base_lr = scaled_base_lr(cfg.OPTIM, batch)
    steps_per_epoch = len(train.sampler) // global_batch(cfg.TRAIN)
    log_run(cfg, env, model, train, val, steps_per_epoch, base_lr)
    telemetry = build_telemetry(cfg, model, env, teacher)  # FLOPs counted on the plain models, before any wrapper
    parallel = parallelize(model, cfg, env)
    if teacher is not None and cfg.DISTILL.SHARD_TEACHER and parallel.mesh is not None:
        shard_model(
            teacher.module, find_blocks(teacher.module), parallel.mesh, None, reshard_after_forward=True
        )  # fp32, run under autocast
    criterion = distilled(train_criterion(cfg, task, train), cfg.DISTILL, teacher)
    return Run(
        cfg=cfg,
        env=env,
        model=parallel.model,
        forward_model=parallel.forward_model,
        eval_model=parallel.eval_model,
        # Built after sharding: fully_shard replaces the parameters.
        optimizer=build_optimizer(
            parallel.model, cfg.OPTIM, zero=cfg.OPTIM.ZERO and is_dist(), fused=fused_step(cfg, env)
        ),
        scaler=build_scaler(cfg, env),
        task=task,
        criterion=criterion.to(env.device),  # class weights: a buffer
        train=train,
        val=val,
        steps_per_epoch=steps_per_epoch,
        base_lr=base_lr,
        ema=parallel.ema,
        mixer=build_batch_mixer(cfg),
        extra_val=extra_val,
        precise_bn=build_precise_bn_split(cfg, env) if cfg.BN.PRECISE_IMAGES else None,
        teacher=teacher,
        best=Best(cfg.TRAIN.BEST_METRIC),
        telemetry=telemetry,
    )


def build_telemetry(cfg: CfgNode, model: nn.Module, env: DistEnv, teacher: Teacher | None = None) -> Telemetry:
    """The run's timing records: model FLOPs of a training image at each size the run trains at
    (``FlopCounterMode`` on one image: x 3 for the backward, plus the teacher's forward under
    distillation), LOG.PEAK_TFLOPS for MFU and LOG.STRAGGLER_FACTOR."""
    sizes = sorted({progressive(cfg).size_at(e) for e in range(cfg.OPTIM.MAX_EPOCH)} | {cfg.TRAIN.IM_SIZE})
    by_size = {size: training_flops(cfg, model, env, teacher, size) for size in sizes}
    per_image = by_size[cfg.TRAIN.IM_SIZE]
    logger.info(
        "model FLOPs: %.4g GFLOP a training image at %d px (a forward x %d%s; torch.utils.flop_counter)%s%s",
        per_image / 1e9, cfg.TRAIN.IM_SIZE, TRAINING_FLOPS_PER_FORWARD, ", plus the teacher's forward" if teacher else "",
        "; " + ", ".join(f"{by_size[s] / 1e9:.4g} at {s} px" for s in sizes if s != cfg.TRAIN.IM_SIZE) if len(sizes) > 1 else "",
        f"; MFU against LOG.PEAK_TFLOPS {cfg.LOG.PEAK_TFLOPS:g}" if cfg.LOG.PEAK_TFLOPS else "",
    )  # fmt: skip
    return Telemetry(per_image, cfg.LOG.PEAK_TFLOPS, cfg.LOG.STRAGGLER_FACTOR, by_size)


def training_flops(cfg: CfgNode, model: nn.Module, env: DistEnv, teacher: Teacher | None, size: int) -> float:
    """FLOPs of one training image at ``size``: the student's forward and backward, the teacher's forward."""
    flops = TRAINING_FLOPS_PER_FORWARD * forward_flops(model, size, env.device, cfg.TRAIN.CHANNELS_LAST)
    return flops + (forward_flops(teacher.module, size, env.device, cfg.TRAIN.CHANNELS_LAST) if teacher else 0)


def fused_step(cfg: CfgNode, env: DistEnv) -> bool:
    """Whether the optimizer steps with its fused kernel: fp16 or bf16 on a replicated model (one
    kernel over every parameter rather than foreach's few per group; the same updates, tests/integration/test_levers.py)."""
    return cfg.TRAIN.PRECISION in ("fp16", "bf16") and not shards(cfg, env)


def log_run(
    cfg: CfgNode, env: DistEnv, model: nn.Module, train: Split, val: Split, steps_per_epoch: int, base_lr: float
) -> None:
    """One line of what is trained on what, in which batches; the progressive schedule, if any."""
    t, batch = cfg.TRAIN, global_batch(cfg.TRAIN, env.world_size)
    logger.info(
        "%s: %.2fM parameters; %d train / %d val images, %d classes; global batch %d "
        "(%d x %d ranks x %d accumulation); %d steps/epoch; base LR %.5g%s",
        cfg.MODEL.ARCH, count_parameters(model) / 1e6, len(train.dataset), len(val.dataset),
        len(train.classes), batch, t.BATCH_SIZE, env.world_size, t.ACCUM_STEPS,
        steps_per_epoch, base_lr,
        f" (OPTIM.BASE_LR x {batch}/{cfg.OPTIM.REFERENCE_BATCH})" if cfg.OPTIM.REFERENCE_BATCH else "",
    )  # fmt: skip
    if progressive(cfg).on:
        log_progressive_schedule(cfg)


def log_progressive_schedule(cfg: CfgNode) -> None:
    """Log the training crop of each epoch; warn when the run ends inside the ramp, below TRAIN.IM_SIZE."""
    schedule = progressive(cfg)
    logger.info("progressive resizing (TRAIN.PROGRESSIVE_*): %s", schedule.text())
    last = schedule.size_at(cfg.OPTIM.MAX_EPOCH - 1)
    if last != cfg.TRAIN.IM_SIZE:
        logger.warning(
            "TRAIN.PROGRESSIVE_END_EPOCH %d is not below OPTIM.MAX_EPOCH %d: the last epoch trains at %d px, "
            "not TRAIN.IM_SIZE %d", cfg.TRAIN.PROGRESSIVE_END_EPOCH, cfg.OPTIM.MAX_EPOCH, last, cfg.TRAIN.IM_SIZE,
        )  # fmt: skip


def train_criterion(cfg: CfgNode, task: Task, train: Split) -> nn.Module:
    """TRAIN.LOSS with label smoothing, the BCE threshold and TRAIN.CLASS_WEIGHTS from the train split."""
    t, weights = cfg.TRAIN, None
    if t.CLASS_WEIGHTS == "balanced":
        targets = getattr(train.dataset, "base", train.dataset).targets
        try:
            found = task.balanced_weights(list(targets), len(train.classes))
        except ValueError as e:
            raise ConfigError(f"TRAIN.CLASS_WEIGHTS balanced: {e}") from None
        # Outputs beyond the dataset's classes (MODEL.NUM_CLASSES larger) never are targets: weight 1.
        weights = torch.ones(cfg.MODEL.NUM_CLASSES)
        weights[: len(found)] = found
        logger.info("TRAIN.CLASS_WEIGHTS balanced: %s", ", ".join(f"{w:.3g}" for w in found.tolist()))
    return task.criterion(t.LOSS, t.LABEL_SMOOTHING, t.BCE_TARGET_THRESHOLD or None, weights)


def distilled(criterion: nn.Module, distill_cfg: CfgNode, teacher: Teacher | None) -> nn.Module:
    """The training loss, mixed with the teacher's (DISTILL.ALPHA, TEMPERATURE, HARD) when there is one."""
    if teacher is None:
        return criterion
    return DistillationLoss(criterion, distill_cfg.ALPHA, distill_cfg.TEMPERATURE, distill_cfg.HARD)
