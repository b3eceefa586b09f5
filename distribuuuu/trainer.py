"""The training and evaluation loops: train_epoch, validate, train_model, test_model."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as ckpt
from distribuuuu.config import ConfigError, check_dataset_paths, dump_cfg
from distribuuuu.data import Split, build_batch_mixer, build_train_split, build_val_split, check_same_classes
from distribuuuu.distributed import (
    DistEnv,
    all_gather_object,
    broadcast_buffers,
    broadcast_object,
    check_group,
    cleanup_distributed,
    format_rank_table,
    is_dist,
    setup_distributed,
)
from distribuuuu.ema import ModelEMA
from distribuuuu.errors import first_line
from distribuuuu.faults import (
    NonFiniteLossError,
    Preempted,
    PreemptionHandler,
    capture_rng_state,
    collective_error,
    is_comm_failure,
    requeue_slurm_job,
    restore_rng_state,
    seed_everything,
)
from distribuuuu.logger import get_logger, make_writer, setup_logging
from distribuuuu.meters import MetricSums
from distribuuuu.models import build_model, count_parameters, has_batchnorm, model_source
from distribuuuu.optim import build_optimizer, lr_at, scaled_base_lr, set_lr

logger = get_logger("trainer")


@dataclass
class TrainState:
    """Progress that a checkpoint restores."""

    epoch: int = 0  # completed epochs
    step_in_epoch: int = 0  # optimizer steps done in the epoch in progress
    best_acc1: float = 0.0
    best_weights: str = "model"  # which weights reached best_acc1: "model" or "ema"


@dataclass
class Run:
    """Everything one training run holds: built once by build_run, then used by the loops."""

    cfg: CfgNode
    env: DistEnv
    model: nn.Module  # the plain model: its state_dict is what checkpoints hold
    forward_model: nn.Module  # what training calls: compiled and/or DDP-wrapped
    eval_model: nn.Module  # what evaluation calls: compiled or plain, never DDP
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
    state: TrainState = field(default_factory=TrainState)
    preempt: PreemptionHandler | None = None

    @property
    def global_step(self) -> int:
        return self.state.epoch * self.steps_per_epoch + self.state.step_in_epoch


# ------------------------------------------------------------------------------------------------
# Set-up
# ------------------------------------------------------------------------------------------------
def setup_environment(cfg: CfgNode) -> tuple[DistEnv, object]:
    """Start the process group, check it, prepare OUT_DIR, logging, seeds and cuDNN."""
    env = setup_distributed(cfg.DIST.BACKEND, cfg.DIST.TIMEOUT_S, join_timeout_s=cfg.DIST.INIT_CHECK_TIMEOUT_S)
    table = check_group(env, cfg.DIST.INIT_CHECK_TIMEOUT_S)
    # Rank 0 checks OUT_DIR; every rank learns the verdict, so all stop together, quietly but one.
    problem = _prepare_out_dir(cfg.OUT_DIR) if env.is_main_process else None
    problem = broadcast_object(problem)
    if problem:
        raise ConfigError(problem)
    setup_logging(cfg.OUT_DIR if env.is_main_process else None, env.rank)
    logger.info("%s launch, %d process(es):\n%s", env.launcher, env.world_size, format_rank_table(table))
    if cfg.TRAIN.PRECISION == "fp16" and env.device.type == "cpu":
        logger.warning("TRAIN.PRECISION fp16 on the CPU is slow and meant for testing the fp16 path; use bf16")
    seed_everything(cfg.RNG_SEED + env.rank)
    torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK
    torch.backends.cudnn.deterministic = cfg.CUDNN.DETERMINISTIC
    if env.is_main_process:
        dump_cfg(cfg, cfg.OUT_DIR)
    writer = make_writer(cfg.OUT_DIR, env.is_main_process)
    return env, writer


def _prepare_out_dir(out_dir: str) -> str | None:
    """Create OUT_DIR/checkpoints and prove it writable; return a message if it is not."""
    try:
        os.makedirs(os.path.join(out_dir, ckpt.CKPT_DIR), exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"OUT_DIR: cannot write to {out_dir}: {e.strerror or e}"
    return None


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
    if cfg.TRAIN.CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    return model


def wrap_model(model: nn.Module, cfg: CfgNode, env: DistEnv) -> nn.Module:
    """torch.compile (optional), then DDP with the configured knobs when there are several ranks."""
    forward = torch.compile(model) if cfg.TRAIN.COMPILE else model
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


def build_run(cfg: CfgNode, env: DistEnv, writer) -> Run:
    """Build loaders, model, optimizer, scaler, EMA and loss for a training run."""
    train, val = build_train_split(cfg, env), build_val_split(cfg, env)
    check_same_classes(train, val, cfg)
    model = build_model_for(cfg, env)
    t = cfg.TRAIN
    global_batch = t.BATCH_SIZE * env.world_size * t.ACCUM_STEPS
    base_lr = scaled_base_lr(cfg.OPTIM, global_batch)
    steps_per_epoch = len(train.sampler) // t.BATCH_SIZE // t.ACCUM_STEPS
    logger.info(
        "%s: %.2fM parameters; %d train / %d val images, %d classes; global batch %d "
        "(%d x %d ranks x %d accumulation); %d steps/epoch; base LR %.5g%s",
        cfg.MODEL.ARCH, count_parameters(model) / 1e6, len(train.dataset), len(val.dataset),
        len(train.classes), global_batch, t.BATCH_SIZE, env.world_size, t.ACCUM_STEPS,
        steps_per_epoch, base_lr,
        f" (OPTIM.BASE_LR x {global_batch}/{cfg.OPTIM.REFERENCE_BATCH})" if cfg.OPTIM.REFERENCE_BATCH else "",
    )  # fmt: skip
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
        optimizer=build_optimizer(model, cfg.OPTIM, zero=cfg.OPTIM.ZERO and is_dist(), fused=t.PRECISION == "fp16"),
        scaler=torch.amp.GradScaler(env.device.type, enabled=t.PRECISION == "fp16"),
        criterion=nn.CrossEntropyLoss(label_smoothing=t.LABEL_SMOOTHING),
        train=train,
        val=val,
        steps_per_epoch=steps_per_epoch,
        base_lr=base_lr,
        writer=writer,
        ema=ema,
        mixer=build_batch_mixer(cfg),
    )


# ------------------------------------------------------------------------------------------------
# One optimizer step
# ------------------------------------------------------------------------------------------------
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
    """Skip DDP's gradient all-reduce on accumulation micro-batches other than the last."""
    if sync or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def train_step(run: Run, micro_batches: list, sums: MetricSums) -> torch.Tensor:
    """Forward and backward each micro-batch, then one optimizer step; return the mean loss."""
    cfg, env = run.cfg, run.env
    losses = []
    for i, (images, targets, skipped) in enumerate(micro_batches):
        images, targets = to_device(images, targets, env, cfg.TRAIN.CHANNELS_LAST)
        soft_targets = targets
        if run.mixer is not None:
            images, soft_targets = run.mixer(images, targets)
        with gradient_sync(run.forward_model, i == len(micro_batches) - 1), autocast(cfg.TRAIN.PRECISION, env.device):
            logits = run.forward_model(images)
            loss = run.criterion(logits.float(), soft_targets)
        run.scaler.scale(loss / len(micro_batches)).backward()
        sums.add(loss, logits, targets)
        if skipped:
            sums.add_field("skipped_images", skipped)
        losses.append(loss.detach())
    optimizer_step(run, sums)
    return torch.stack(losses).mean()


def optimizer_step(run: Run, sums: MetricSums) -> None:
    """Unscale, clip, step (or skip a non-finite step), update the scaler and the EMA.

    Skipped steps are counted once per optimizer step: gradients are already all-reduced, so
    every rank sees the same norm and takes the same decision, and ``add_once`` counts it on one.
    """
    cfg, optimizer = run.cfg, run.optimizer
    run.scaler.unscale_(optimizer)  # no-op unless fp16: clipping must see the true gradients
    grad_norm = gradient_norm(run)
    if run.scaler.is_enabled():
        # GradScaler skips exactly the steps whose unscaled gradients hold an inf or NaN, which is
        # when their norm is not finite: counted on the device, with no host sync (get_scale()
        # would copy the scale to the host every step).
        sums.add_once("skipped_steps", ~torch.isfinite(grad_norm))
        run.scaler.step(optimizer)
        run.scaler.update()
    elif cfg.TRAIN.NAN_POLICY == "skip" and not torch.isfinite(grad_norm).item():
        # With NAN_POLICY "skip" the step needs the norm on the host: that one sync is its price.
        sums.add_once("skipped_steps", 1)
        optimizer.zero_grad(set_to_none=True)
        return
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if run.ema is not None and (run.global_step + 1) % cfg.OPTIM.EMA_PERIOD == 0:
        run.ema.update(run.model)


def gradient_norm(run: Run) -> torch.Tensor | None:
    """The global gradient norm (clipping to TRAIN.CLIP_GRAD_NORM first), or None when nothing needs it."""
    t = run.cfg.TRAIN
    if t.CLIP_GRAD_NORM > 0:
        return nn.utils.clip_grad_norm_(run.model.parameters(), t.CLIP_GRAD_NORM, foreach=True)
    if run.scaler.is_enabled() or t.NAN_POLICY == "skip":
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        return nn.utils.get_total_norm(grads, foreach=True)
    return None


# ------------------------------------------------------------------------------------------------
# Epoch loops
# ------------------------------------------------------------------------------------------------
def train_epoch(run: Run, epoch: int) -> dict:
    """Train one epoch (from run.state.step_in_epoch on); return the epoch's reduced totals.

    Metrics stay on the device between synchronisation points: every PRINT_FREQ steps and at
    the last step, one all-reduce carries the metrics, the preemption flag and the non-finite
    count. No other step syncs the host or talks to the other ranks.
    """
    cfg, t = run.cfg, run.cfg.TRAIN
    start = run.state.step_in_epoch
    run.train.sampler.set_epoch(epoch)
    run.train.sampler.set_start(start * t.BATCH_SIZE * t.ACCUM_STEPS)
    run.forward_model.train()
    batches = iter(run.train.loader)
    window, epoch_totals = MetricSums(run.env.device, t.TOPK), {}
    window_losses: list[torch.Tensor] = []
    clock = {"data": 0.0, "start": time.perf_counter(), "epoch_start": time.perf_counter()}
    for step in range(start, run.steps_per_epoch):
        tic = time.perf_counter()
        micro_batches = [next(batches) for _ in range(t.ACCUM_STEPS)]
        clock["data"] += time.perf_counter() - tic
        set_lr(run.optimizer, lr_at(run.global_step, run.steps_per_epoch, cfg.OPTIM, run.base_lr))
        try:
            window_losses.append(train_step(run, micro_batches, window))
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise  # a bug in the model or the step: its traceback is what the user needs
            raise _with_context(e, run, epoch, step) from e
        run.state.step_in_epoch = step + 1
        # A mid-epoch checkpoint is a sync point too: its weights pass the non-finite check first.
        checkpoint_due = t.CKPT_PERIOD_ITERS and (step + 1) % t.CKPT_PERIOD_ITERS == 0
        checkpoint_due = checkpoint_due and step + 1 < run.steps_per_epoch
        if (step + 1) % t.PRINT_FREQ == 0 or step + 1 == run.steps_per_epoch or checkpoint_due:
            totals = sync_point(run, window, window_losses, epoch, step + 1, clock)
            _accumulate(epoch_totals, totals)
            if totals["stop"]:
                stop_for_preemption(run)
        if checkpoint_due:
            save_training_checkpoint(run)
    epoch_totals["time_s"] = time.perf_counter() - clock["epoch_start"]
    return epoch_totals


def _with_context(e: RuntimeError, run: Run, epoch: int, step: int) -> RuntimeError:
    """Name the rank, epoch and step of a failed step, and the stalled peers of a failed all-reduce."""
    what = f"training step (forward, backward, gradient all-reduce) at epoch {epoch + 1}, step {step + 1}"
    return collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S)


def _accumulate(acc: dict, totals: dict) -> None:
    for key in ("loss_sum", "loss_samples", "top1", "topk", "samples", "nonfinite", "skipped_images", "skipped_steps"):
        acc[key] = acc.get(key, 0.0) + totals[key]


def sync_point(run: Run, window: MetricSums, window_losses: list, epoch: int, step: int, clock: dict) -> dict:
    """Reduce the window's metrics over ranks (one all-reduce), check them, log them, reset."""
    window.add_field("stop", float(run.preempt is not None and run.preempt.requested))
    try:
        totals = window.reduce()
    except RuntimeError as e:
        what = f"metrics all-reduce at epoch {epoch + 1}, step {step}"
        raise collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S) from e
    if totals["nonfinite"] and run.cfg.TRAIN.NAN_POLICY == "stop":
        raise NonFiniteLossError(
            f"non-finite loss at epoch {epoch + 1}, step {_first_nonfinite_step(window_losses, step)}: "
            "lower OPTIM.BASE_LR, enable TRAIN.CLIP_GRAD_NORM, or set TRAIN.NAN_POLICY skip"
        )
    elapsed = time.perf_counter() - clock["start"]
    steps = len(window_losses)
    eta_s = (
        elapsed
        / max(steps, 1)
        * (run.steps_per_epoch - step + (run.cfg.OPTIM.MAX_EPOCH - epoch - 1) * run.steps_per_epoch)
    )
    logger.info(
        "epoch %d/%d  step %d/%d  loss %.4f  top1 %.2f  top%d %.2f  lr %.5g  %.0f img/s  data %.3fs/step  eta %s%s",
        epoch + 1, run.cfg.OPTIM.MAX_EPOCH, step, run.steps_per_epoch, totals["loss"], totals["top1_acc"],
        run.cfg.TRAIN.TOPK, totals["topk_acc"], run.optimizer.param_groups[0]["lr"],
        totals["samples"] / max(elapsed, 1e-9), clock["data"] / max(steps, 1), _hms(eta_s),
        f"  {_skipped_what(run)} {int(totals['skipped_steps'])}" if totals["skipped_steps"] else "",
    )  # fmt: skip
    window.reset()
    window_losses.clear()
    clock.update(data=0.0, start=time.perf_counter())
    return totals


def _skipped_what(run: Run) -> str:
    return "fp16 overflow steps skipped" if run.scaler.is_enabled() else "non-finite steps skipped"


def _first_nonfinite_step(window_losses: list, last_step: int) -> int:
    """The first step of the window whose loss was non-finite (same on every rank)."""
    losses = torch.stack(window_losses)
    bad = (~torch.isfinite(losses)).nonzero()
    local = last_step - len(window_losses) + 1 + int(bad[0]) if len(bad) else last_step + 1
    if is_dist():
        box = torch.tensor([local], dtype=torch.int64, device=losses.device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        local = int(box.item())
    return local


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@torch.no_grad()
def validate(model: nn.Module, split: Split, cfg: CfgNode, env: DistEnv) -> dict:
    """Evaluate every val sample exactly once across ranks; return exact totals and means."""
    model.eval()
    sums = MetricSums(env.device, cfg.TRAIN.TOPK)
    tic = time.perf_counter()
    for i, (images, targets, skipped) in enumerate(split.loader):
        images, targets = to_device(images, targets, env, cfg.TRAIN.CHANNELS_LAST)
        with autocast(cfg.TRAIN.PRECISION, env.device):
            logits = model(images)
        sums.add(nn.functional.cross_entropy(logits.float(), targets), logits, targets)
        if skipped:
            sums.add_field("skipped_images", skipped)
        if (i + 1) % cfg.TEST.PRINT_FREQ == 0:
            logger.info("val  batch %d/%d (rank 0)", i + 1, len(split.loader))
    totals = sums.reduce()
    totals["time_s"] = time.perf_counter() - tic
    totals["images_per_s"] = totals["samples"] / max(totals["time_s"], 1e-9)
    return totals


# ------------------------------------------------------------------------------------------------
# Checkpoints and resume
# ------------------------------------------------------------------------------------------------
def training_state(run: Run) -> dict:
    """Everything continuing needs; collective (ZeRO consolidation, RNG gather): call on all ranks."""
    optimizer = run.optimizer
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather the shards on rank 0
        optimizer.consolidate_state_dict(to=0)
        opt_state = optimizer.state_dict() if run.env.is_main_process else None
    else:
        opt_state = optimizer.state_dict()
    return {
        "model": run.model.state_dict(),
        "optimizer": opt_state,
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "ema": run.ema.state_dict() if run.ema is not None else None,
        "epoch": run.state.epoch,
        "step_in_epoch": run.state.step_in_epoch,
        "steps_per_epoch": run.steps_per_epoch,
        "best_acc1": run.state.best_acc1,
        "best_weights": run.state.best_weights,
        "rng": all_gather_object(capture_rng_state()),
        "world_size": run.env.world_size,
        "classes": run.train.classes,
        "arch": run.cfg.MODEL.ARCH,
        "cfg": run.cfg.dump(),
    }


def save_training_checkpoint(run: Run, is_best: bool = False) -> str:
    """Write the current state to OUT_DIR/checkpoints (and best.pth.tar); all ranks call this."""
    state = training_state(run)
    epoch_1based = run.state.epoch + (1 if run.state.step_in_epoch else 0)
    ckpt_dir = os.path.join(run.cfg.OUT_DIR, ckpt.CKPT_DIR)
    path = os.path.join(ckpt_dir, ckpt.checkpoint_name(epoch_1based, run.state.step_in_epoch))
    error = None
    if run.env.is_main_process:
        try:
            ckpt.save_checkpoint(state, path)
            if is_best:
                _copy_atomic(path, os.path.join(run.cfg.OUT_DIR, ckpt.BEST_NAME))
            ckpt.prune_checkpoints(ckpt_dir, run.cfg.TRAIN.KEEP_CKPTS)
        except (ckpt.CheckpointError, OSError) as e:
            error = str(e)
    error = broadcast_object(error)  # every rank stops on a failed write, not only rank 0
    if error:
        raise ckpt.CheckpointError(error)
    logger.info("saved %s%s", path, " (best)" if is_best else "")
    return path


def _copy_atomic(src: str, dst: str) -> None:
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ckpt.CheckpointError(f"could not write {dst}: {e}; the previous one is intact") from None


def resume_or_load_weights(run: Run) -> None:
    """Resume from the newest valid checkpoint (AUTO_RESUME), else load MODEL.WEIGHTS if given."""
    cfg = run.cfg
    path = None
    if cfg.TRAIN.AUTO_RESUME:
        ckpt_dir = os.path.join(cfg.OUT_DIR, ckpt.CKPT_DIR)
        path = broadcast_object(ckpt.find_resumable(ckpt_dir) if run.env.is_main_process else None)
    if path:
        if cfg.MODEL.WEIGHTS:
            logger.info("resuming from %s: it wins over MODEL.WEIGHTS %s", path, cfg.MODEL.WEIGHTS)
        # Always read to the CPU: load_state_dict copies weights to their device, and the RNG
        # states must stay CPU byte tensors (torch.set_rng_state, torch.cuda.set_rng_state).
        restore_training_state(run, ckpt.load_checkpoint(path, map_location="cpu"), path)
        logger.info("resumed from %s at epoch %d, step %d", path, run.state.epoch + 1, run.state.step_in_epoch)
    elif cfg.MODEL.WEIGHTS:
        load_weights(run.model, cfg.MODEL.WEIGHTS, cfg.MODEL.WEIGHTS_KIND, strict=False)
        if run.ema is not None:
            run.ema.module.load_state_dict(run.model.state_dict())


def restore_training_state(run: Run, state: dict, path: str) -> None:
    """Load a training checkpoint into the run (weights always; the rest with LOAD_OPT)."""
    run.model.load_state_dict(ckpt.model_state_from(state))
    run.state = TrainState(state["epoch"], state["step_in_epoch"], state["best_acc1"], state["best_weights"])
    if state["steps_per_epoch"] != run.steps_per_epoch and run.state.step_in_epoch:
        # Another world size or batch: continue at the same fraction of the epoch.
        run.state.step_in_epoch = round(run.state.step_in_epoch * run.steps_per_epoch / state["steps_per_epoch"])
        logger.warning(
            "steps per epoch changed from %d to %d: mid-epoch resume is approximate",
            state["steps_per_epoch"],
            run.steps_per_epoch,
        )
    if not run.cfg.TRAIN.LOAD_OPT:
        return
    load_optimizer_state(run.optimizer, state, run.cfg.OPTIM.OPTIMIZER, path)
    if state["scaler"] and run.scaler.is_enabled():
        run.scaler.load_state_dict(state["scaler"])
    if state["ema"] and run.ema is not None:
        run.ema.load_state_dict(state["ema"])
    if run.env.rank < len(state["rng"]) and state["world_size"] == run.env.world_size:
        restore_rng_state(state["rng"][run.env.rank])


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, optimizer_name: str, path: str) -> None:
    """Load a checkpoint's optimizer state, or raise CheckpointError naming the file and the way out.

    PyTorch checks only the parameter-group sizes: SGD's state loads into AdamW without complaint
    and fails at the first step with a KeyError, so the optimizer's name is compared first.
    """
    hint = "set TRAIN.LOAD_OPT False to resume from its weights only"
    saved = CfgNode.load_cfg(state["cfg"]).get("OPTIM", {}).get("OPTIMIZER") if state.get("cfg") else None
    if saved and saved != optimizer_name:
        raise ckpt.CheckpointError(
            f"{path} holds {saved} optimizer state but OPTIM.OPTIMIZER is {optimizer_name}: {hint}"
        )
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise ckpt.CheckpointError(
            f"{path}: its optimizer state does not fit this run ({first_line(e)}): {hint}"
        ) from None


def load_weights(model: nn.Module, path: str, kind: str = "model", strict: bool = True) -> dict:
    """Load MODEL.WEIGHTS into ``model``; with strict=False, tensors of another shape are skipped."""
    state = ckpt.load_checkpoint(path)
    weights = ckpt.model_state_from(state, kind)
    if not strict:
        own = model.state_dict()
        skipped = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
        weights = {k: v for k, v in weights.items() if k not in skipped}
        if skipped:
            logger.info("MODEL.WEIGHTS: skipped %d tensors of another shape (new head?): %s", len(skipped), skipped[:4])
    result = model.load_state_dict(weights, strict=strict)
    if not strict and (result.missing_keys or result.unexpected_keys):
        logger.warning(
            "MODEL.WEIGHTS %s: missing %s, unexpected %s", path, result.missing_keys[:4], result.unexpected_keys[:4]
        )
    logger.info("loaded %s weights from %s", kind, path)
    return state


def stop_for_preemption(run: Run) -> None:
    """Checkpoint at this (synchronised) step, requeue if asked, and raise Preempted."""
    if run.preempt is not None:
        run.preempt.stop_requested_by_peer()  # a no-op on the ranks that got the signal themselves
    signal_name = run.preempt.signal_name if run.preempt is not None else "a peer's signal"
    logger.warning(
        "preemption (%s): checkpointing at epoch %d, step %d", signal_name, run.state.epoch + 1, run.state.step_in_epoch
    )
    save_training_checkpoint(run)
    if run.cfg.DIST.REQUEUE and run.env.is_main_process:
        requeue_slurm_job()
    raise Preempted(f"preempted at epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}")


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def train_model(cfg: CfgNode) -> dict:
    """Train MODEL.ARCH as configured; return the last validation totals."""
    check_dataset_paths(cfg)
    model_source(cfg.MODEL.ARCH)  # an unknown architecture fails before any set-up
    env, writer = setup_environment(cfg)
    run: Run | None = None
    try:
        run = build_run(cfg, env, writer)
        resume_or_load_weights(run)
        last_val: dict = {}
        first_epoch = run.state.epoch
        with PreemptionHandler(cfg.DIST.PREEMPT_GRACE_S) as run.preempt:
            for epoch in range(first_epoch, cfg.OPTIM.MAX_EPOCH):
                train_totals = train_epoch(run, epoch)
                sync_buffers(run)
                write_train_record(run, epoch, train_totals)
                run.state = TrainState(epoch + 1, 0, run.state.best_acc1, run.state.best_weights)
                is_best = False
                if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or epoch + 1 == cfg.OPTIM.MAX_EPOCH:
                    last_val, is_best = evaluate_epoch(run, epoch)
                save_training_checkpoint(run, is_best)
                if cfg.TRAIN.STOP_AFTER_EPOCHS and epoch + 1 - first_epoch >= cfg.TRAIN.STOP_AFTER_EPOCHS:
                    break
        return last_val
    except RuntimeError as e:
        # A raw backend error from a collective outside the training step (validation, checkpoint,
        # resume): our own errors already carry their context and pass through unchanged.
        if not is_dist() or not (type(e) is RuntimeError or isinstance(e, dist.DistError)) or not is_comm_failure(e):
            raise
        state = run.state if run is not None else TrainState()
        what = f"collective outside a training step, at epoch {state.epoch + 1}, step {state.step_in_epoch}"
        raise collective_error(e, env.rank, env.world_size, what, cfg.DIST.TIMEOUT_S) from e
    finally:
        writer.close()
        cleanup_distributed()


def sync_buffers(run: Run) -> None:
    """Give every rank rank 0's BatchNorm statistics (raw and EMA), so all evaluate what is saved.

    DDP broadcasts rank 0's buffers before each forward, and the forward then updates each rank's
    running statistics from its own batch: after an epoch's last step they differ across ranks
    (SyncBatchNorm aside), and a rank validating its shard would score other weights than the
    checkpoint holds. Once per epoch, before evaluation and the checkpoint.
    """
    broadcast_buffers(run.model)
    if run.ema is not None:
        broadcast_buffers(run.ema.module)


def evaluate_epoch(run: Run, epoch: int) -> tuple[dict, bool]:
    """Validate the raw weights (and the EMA weights); update the best; log and record."""
    candidates = [("model", run.eval_model)] + ([("ema", run.ema.module)] if run.ema is not None else [])
    is_best, results = False, {}
    for name, module in candidates:
        totals = validate(module, run.val, run.cfg, run.env)
        results[name] = totals
        write_eval_record(run.writer, "val", epoch + 1, totals, run.cfg.TRAIN.TOPK, name)
        logger.info(
            "val %s epoch %d: loss %.4f  top1 %.2f  top%d %.2f  (%d images, %.0f img/s)",
            name, epoch + 1, totals["loss"], totals["top1_acc"], run.cfg.TRAIN.TOPK, totals["topk_acc"],
            totals["samples"], totals["images_per_s"],
        )  # fmt: skip
        if totals["top1_acc"] > run.state.best_acc1:
            run.state.best_acc1, run.state.best_weights, is_best = totals["top1_acc"], name, True
    return results["model"], is_best


def write_train_record(run: Run, epoch: int, totals: dict) -> None:
    """Append the epoch's training line to metrics.jsonl."""
    n = max(totals.get("samples", 0.0), 1.0)
    run.writer.write(
        {
            "epoch": epoch + 1,
            "split": "train",
            "loss": totals.get("loss_sum", 0.0) / max(totals.get("loss_samples", 0.0), 1.0),
            "top1": 100.0 * totals.get("top1", 0.0) / n,
            "topk": 100.0 * totals.get("topk", 0.0) / n,
            "k": run.cfg.TRAIN.TOPK,
            "lr": run.optimizer.param_groups[0]["lr"],
            "images_per_s": totals.get("samples", 0.0) / max(totals["time_s"], 1e-9),
            "time_s": totals["time_s"],
            "samples": int(totals.get("samples", 0)),
            "nonfinite_steps": 0 if run.scaler.is_enabled() else int(totals.get("skipped_steps", 0)),
            "skipped_images": int(totals.get("skipped_images", 0)),
            "scaler_skips": int(totals.get("skipped_steps", 0)) if run.scaler.is_enabled() else 0,
            "step": run.global_step,
        }
    )


def write_eval_record(writer, split: str, epoch: int, totals: dict, k: int, weights: str = "model") -> None:
    """Append an evaluation line (val or test) to metrics.jsonl."""
    writer.write(
        {
            "epoch": epoch,
            "split": split,
            "weights": weights,
            "loss": totals["loss"],
            "top1": totals["top1_acc"],
            "topk": totals["topk_acc"],
            "k": k,
            "images_per_s": totals["images_per_s"],
            "time_s": totals["time_s"],
            "samples": int(totals["samples"]),
            "skipped_images": int(totals["skipped_images"]),
        }
    )


def test_model(cfg: CfgNode) -> dict:
    """Evaluate MODEL.WEIGHTS on the val split; append a ``test`` line to metrics.jsonl."""
    if not cfg.MODEL.WEIGHTS:
        raise ConfigError("MODEL.WEIGHTS must name a checkpoint: test_net.py refuses to run without weights")
    check_dataset_paths(cfg)
    model_source(cfg.MODEL.ARCH)
    env, writer = setup_environment(cfg)
    try:
        val = build_val_split(cfg, env)
        model = build_model_for(cfg, env)
        state = load_weights(model, cfg.MODEL.WEIGHTS, cfg.MODEL.WEIGHTS_KIND)
        if cfg.TRAIN.COMPILE:
            model = torch.compile(model)
        totals = validate(model, val, cfg, env)
        epoch = int(state.get("epoch", 0)) if isinstance(state.get("epoch"), int) else 0
        write_eval_record(writer, "test", epoch, totals, cfg.TRAIN.TOPK, cfg.MODEL.WEIGHTS_KIND)
        logger.info(
            "test %s: top1 %.3f  top%d %.3f  loss %.4f  (%d images)",
            cfg.MODEL.WEIGHTS, totals["top1_acc"], cfg.TRAIN.TOPK, totals["topk_acc"], totals["loss"], totals["samples"],
        )  # fmt: skip
        return totals
    finally:
        writer.close()
        cleanup_distributed()


test_model.__test__ = False  # a library entry point, not a pytest test
