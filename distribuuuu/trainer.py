"""The training algorithm: train_step, optimizer_step, train_epoch, validate, train_model, test_model.

Everything else has its own home: the run's set-up (``run.py``), what a checkpoint holds and
resuming it (``state.py``), the records (``records.py``), preemption, RNG and fault handling.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError, check_dataset_paths, eval_crop_size
from distribuuuu.data import Split, build_val_split, sample_paths
from distribuuuu.distributed import broadcast_buffers, cleanup_distributed, rank0_decides
from distribuuuu.evaluation import EvalOutputs
from distribuuuu.faults import check_finite, collective_error, is_comm_failure, naming_failed_collectives
from distribuuuu.heartbeat import report_position
from distribuuuu.launch import DistEnv
from distribuuuu.logger import get_logger, setup_logging
from distribuuuu.meters import MetricSums
from distribuuuu.models import model_source
from distribuuuu.optim import lr_at, set_lr
from distribuuuu.parallel import is_sharded, missing_forwards, norm_value, set_gradient_sync
from distribuuuu.preemption import Preempted, PreemptionHandler, requeue_slurm_job
from distribuuuu.records import log_train_window, write_eval_record, write_train_record
from distribuuuu.run import (
    Run,
    TrainState,
    build_model_for,
    build_run,
    prepare_outputs,
    setup_environment,
    start_process_group,
)
from distribuuuu.state import (
    find_checkpoint_to_resume,
    load_weights,
    log_config_changes,
    resume_or_load_weights,
    save_training_checkpoint,
    warn_if_evaluated_otherwise,
)

logger = get_logger("trainer")


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
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) on micro-batches other than the last."""
    set_gradient_sync(model, sync)  # FSDP2 reads its flag in backward: a setter, before the forward is fine
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
    # Under FSDP2 the gradients are shards (DTensors): the norm is the global one, as a DTensor.
    if t.CLIP_GRAD_NORM > 0:
        return norm_value(nn.utils.clip_grad_norm_(run.model.parameters(), t.CLIP_GRAD_NORM, foreach=True))
    if run.scaler.is_enabled() or t.NAN_POLICY == "skip":
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        return norm_value(nn.utils.get_total_norm(grads, foreach=True))
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
    start, end = start_epoch_sampler(run, epoch)
    run.forward_model.train()
    batches = iter(run.train.loader)
    window, epoch_sums = MetricSums(run.env.device, t.TOPK), MetricSums(torch.device("cpu"), t.TOPK)
    window_losses: list[torch.Tensor] = []
    clock = {"data": 0.0, "start": time.perf_counter(), "epoch_start": time.perf_counter()}
    for step in range(start, end):
        tic = time.perf_counter()
        micro_batches = [next(batches) for _ in range(t.ACCUM_STEPS)]
        clock["data"] += time.perf_counter() - tic
        set_lr(run.optimizer, lr_at(run.schedule_step, run.steps_per_epoch, cfg.OPTIM, run.base_lr))
        try:
            window_losses.append(train_step(run, micro_batches, window))
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise  # a bug in the model or the step: its traceback is what the user needs
            raise _with_context(e, run, epoch, step) from e
        run.state.step_in_epoch = step + 1
        run.state.samples_in_epoch += run.global_batch
        # A mid-epoch checkpoint is a sync point too: its weights pass the non-finite check first.
        checkpoint_due = t.CKPT_PERIOD_ITERS and (step + 1) % t.CKPT_PERIOD_ITERS == 0
        checkpoint_due = checkpoint_due and step + 1 < end
        if (step + 1) % t.PRINT_FREQ == 0 or step + 1 == end or checkpoint_due:
            totals = sync_point(run, window, window_losses, epoch, step + 1, clock)
            epoch_sums.add_totals(totals)
            if totals["stop"]:
                stop_for_preemption(run)
        if checkpoint_due:
            save_training_checkpoint(run)
    return dict(epoch_sums.totals(), time_s=time.perf_counter() - clock["epoch_start"])


def start_epoch_sampler(run: Run, epoch: int) -> tuple[int, int]:
    """Point the train sampler at the epoch's resumed position; return the range of step numbers to run.

    Steps count the optimizer steps taken in the epoch (checkpoint names, EMA period); the
    sampler and the LR follow the global sample position. On the run's own world size the range
    is (step_in_epoch, steps_per_epoch) as always; resumed with another global batch, the epoch
    continues at the saved position and ends when fewer samples than one global batch (per
    rank: BATCH_SIZE x ACCUM_STEPS) are left, as drop_last ends every epoch.
    """
    t, sampler, start = run.cfg.TRAIN, run.train.sampler, run.state.step_in_epoch
    sampler.set_epoch(epoch)
    if not hasattr(sampler, "set_position"):  # repeated/weighted samplers: per-rank position only
        sampler.set_start(start * t.BATCH_SIZE * t.ACCUM_STEPS)
        return start, run.steps_per_epoch
    sampler.set_position(run.state.samples_in_epoch)
    return start, start + len(sampler) // (t.BATCH_SIZE * t.ACCUM_STEPS)


def _with_context(e: RuntimeError, run: Run, epoch: int, step: int) -> RuntimeError:
    """Name the rank, epoch and step of a failed step, and the stalled peers of a failed all-reduce."""
    what = f"training step (forward, backward, gradient all-reduce) at epoch {epoch + 1}, step {step + 1}"
    return collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S)


def sync_point(run: Run, window: MetricSums, window_losses: list, epoch: int, step: int, clock: dict) -> dict:
    """Reduce the window's metrics over ranks (one all-reduce), check them, log them, reset."""
    window.add_field("stop", float(run.preempt is not None and run.preempt.requested))
    try:
        totals = window.reduce()
    except RuntimeError as e:
        what = f"metrics all-reduce at epoch {epoch + 1}, step {step}"
        raise collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S) from e
    check_finite(totals, window_losses, epoch, step, run.cfg.TRAIN.NAN_POLICY)
    elapsed = time.perf_counter() - clock["start"]
    steps_left = run.steps_per_epoch - step + (run.cfg.OPTIM.MAX_EPOCH - epoch - 1) * run.steps_per_epoch
    log_train_window(
        run.writer, totals, epoch, step, run.cfg, run.steps_per_epoch, lr=scheduled_lr(run),
        elapsed_s=elapsed, data_s=clock["data"], steps=len(window_losses), steps_left=steps_left,
        fp16=run.scaler.is_enabled(), global_step=run.global_step,
    )  # fmt: skip
    window.reset()
    window_losses.clear()
    clock.update(data=0.0, start=time.perf_counter())
    return totals


def scheduled_lr(run: Run) -> float:
    """The schedule's LR of the last step taken: what the log shows (a group's LR is it x its lr_scale)."""
    return lr_at(max(run.schedule_step - 1, 0), run.steps_per_epoch, run.cfg.OPTIM, run.base_lr)


@torch.no_grad()
def validate(
    model: nn.Module, split: Split, cfg: CfgNode, env: DistEnv, outputs: tuple[str, str] | None = None
) -> dict:
    """Evaluate every val sample exactly once across ranks; return exact totals and means.

    With ``outputs`` (folder, file prefix), TEST.CONFUSION's and TEST.SAVE_PREDICTIONS's files are
    saved there: one more all-reduce and one gather per evaluation, none per batch.
    """
    model.eval()
    sums = MetricSums(env.device, cfg.TRAIN.TOPK)
    names = split.classes + [str(c) for c in range(len(split.classes), cfg.MODEL.NUM_CLASSES)]
    t = cfg.TEST
    extras = EvalOutputs(len(names), cfg.TRAIN.TOPK, env.device, t.CONFUSION, t.SAVE_PREDICTIONS) if outputs else None
    tic = time.perf_counter()
    # A sharded model all-gathers in every forward: ranks with fewer batches owe empty forwards,
    # counted before the loop (a count taken after it would meet a peer's all-gather: deadlock).
    owed = missing_forwards(len(split.loader), env.device) if is_sharded(model) else 0
    for i, (images, targets, skipped) in enumerate(split.loader):
        images, targets = to_device(images, targets, env, cfg.TRAIN.CHANNELS_LAST)
        with autocast(cfg.TRAIN.PRECISION, env.device):
            logits = model(images)
        sums.add(nn.functional.cross_entropy(logits.float(), targets), logits, targets)
        if extras is not None:
            extras.update(logits, targets, skipped)
        if skipped:
            sums.add_field("skipped_images", skipped)
        if (i + 1) % cfg.TEST.PRINT_FREQ == 0:
            logger.info("val  batch %d/%d (rank 0)", i + 1, len(split.loader))
    run_empty_forwards(model, owed, cfg, env)
    totals = sums.reduce()
    if extras is not None:
        extras.save(*outputs, indices=list(split.sampler), paths=sample_paths(split.dataset), names=names)
    totals["time_s"] = time.perf_counter() - tic
    totals["images_per_s"] = totals["samples"] / max(totals["time_s"], 1e-9)
    return totals


def run_empty_forwards(model: nn.Module, count: int, cfg: CfgNode, env: DistEnv) -> None:
    """Call the (sharded) model ``count`` times on an empty batch, so every rank joins every all-gather.

    The exact eval sampler gives ranks up to one batch more or less; without these the ranks
    with more batches would wait for the others' all-gathers until the timeout.
    """
    size = eval_crop_size(cfg)
    empty = torch.empty(0, 3, size, size, device=env.device)
    for _ in range(count):
        with autocast(cfg.TRAIN.PRECISION, env.device):
            model(empty)


# ------------------------------------------------------------------------------------------------
# Checkpoints and resume
# ------------------------------------------------------------------------------------------------


def stop_for_preemption(run: Run) -> None:
    """Checkpoint at this (synchronised) step, requeue if asked, and raise Preempted."""
    if run.preempt is not None:
        run.preempt.stop_requested_by_peer()  # a no-op on the ranks that got the signal themselves
    signal_name = run.preempt.signal_name if run.preempt is not None else "a peer's signal"
    logger.warning(
        "preemption (%s): checkpointing at epoch %d, step %d", signal_name, run.state.epoch + 1, run.state.step_in_epoch
    )
    save_training_checkpoint(run)  # returns once the checkpoint is complete on every rank
    if run.cfg.DIST.REQUEUE:
        requeue_slurm_job()  # rank 0 alone
    raise Preempted(f"preempted at epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}")


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def train_model(cfg: CfgNode, cleanup: bool = True) -> dict:
    """Train MODEL.ARCH as configured; return the last validation totals.

    ``cleanup`` False keeps the process group for a caller that trains several times in one job.
    """
    check_dataset_paths(cfg)
    model_source(cfg.MODEL.ARCH)  # an unknown architecture fails before any set-up
    env, table = start_process_group(cfg)
    # Before anything is written to OUT_DIR: a checkpoint of another experiment stops the run here.
    resume = rank0_decides(lambda: find_checkpoint_to_resume(cfg))
    if resume.epochs_done >= cfg.OPTIM.MAX_EPOCH:
        report_finished_run(cfg, env, resume.epochs_done)  # a finished run is read, not written
        cleanup_distributed()
        return {}
    resume_from = resume.path
    writer = prepare_outputs(cfg, env, table, resumed_from=resume_from)
    log_config_changes(resume_from, resume.changes)
    run: Run | None = None
    try:
        with naming_failed_collectives(env, cfg.DIST.TIMEOUT_S, lambda: run.state if run else TrainState()):
            run = build_run(cfg, env, writer)
            report_position(lambda: f"epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}")  # for stalls
            resume_or_load_weights(run, resume_from)
            with PreemptionHandler(cfg.DIST.PREEMPT_GRACE_S) as run.preempt:
                last_val = train_epochs(run)
            run.writer.summarize()  # rank 0 (the others hold a NullWriter): summary.md and the plot
            return last_val
    finally:
        writer.close()
        if cleanup:
            cleanup_distributed()


def report_finished_run(cfg: CfgNode, env: DistEnv, epochs_done: int) -> None:
    """Say that OUT_DIR's run is finished, on the console only: its log, config and summary stay as they are."""
    setup_logging(None, env.rank)
    if env.is_main_process:
        logger.warning(
            "%s already holds a finished run (%d epochs trained, OPTIM.MAX_EPOCH %d): nothing to train, nothing "
            "written; raise OPTIM.MAX_EPOCH to train on, or give another OUT_DIR to start a new run",
            cfg.OUT_DIR, epochs_done, cfg.OPTIM.MAX_EPOCH,
        )  # fmt: skip


def train_epochs(run: Run) -> dict:
    """From the resumed epoch on: train, agree on BatchNorm statistics, evaluate, checkpoint."""
    cfg, last_val, first_epoch = run.cfg, {}, run.state.epoch
    for epoch in range(first_epoch, cfg.OPTIM.MAX_EPOCH):
        train_totals = train_epoch(run, epoch)
        sync_buffers(run)
        write_train_record(
            run.writer, epoch + 1, train_totals, cfg.TRAIN.TOPK, scheduled_lr(run), run.global_step,
            run.scaler.is_enabled(),
        )  # fmt: skip
        run.state = TrainState(epoch + 1, 0, run.state.best_acc1, run.state.best_weights)
        is_best = False
        if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or epoch + 1 == cfg.OPTIM.MAX_EPOCH:
            last_val, is_best = evaluate_epoch(run, epoch)
        save_training_checkpoint(run, is_best)
        if cfg.TRAIN.STOP_AFTER_EPOCHS and epoch + 1 - first_epoch >= cfg.TRAIN.STOP_AFTER_EPOCHS:
            break
    return last_val


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
    """Validate the raw weights (and the EMA weights) on val and TEST.EXTRA_DATASETS; update the
    best (from val only); log and record each."""
    candidates = [("model", run.eval_model)] + ([("ema", run.ema.module)] if run.ema is not None else [])
    is_best, results = False, {}
    for split_name, split in [("val", run.val), *run.extra_val.items()]:
        for name, module in candidates:
            prefix = split_name + ("_ema" if name == "ema" else "")
            totals = validate(module, split, run.cfg, run.env, (os.path.join(run.cfg.OUT_DIR, "evaluation"), prefix))
            write_eval_record(run.writer, split_name, epoch + 1, totals, run.cfg.TRAIN.TOPK, name)
            logger.info(
                "%s %s epoch %d: loss %.4f  top1 %.2f  top%d %.2f  (%d images, %.0f img/s)",
                split_name, name, epoch + 1, totals["loss"], totals["top1_acc"], run.cfg.TRAIN.TOPK,
                totals["topk_acc"], totals["samples"], totals["images_per_s"],
            )  # fmt: skip
            if split_name != "val":
                continue
            results[name] = totals
            if totals["top1_acc"] > run.state.best_acc1:
                run.state.best_acc1, run.state.best_weights, is_best = totals["top1_acc"], name, True
    return results["model"], is_best


def test_model(cfg: CfgNode) -> dict:
    """Evaluate MODEL.WEIGHTS on the val split; append a ``test`` line to OUT_DIR/metrics.jsonl.

    OUT_DIR's config.yaml is left alone: evaluating into a training run's folder keeps its record.
    """
    if not cfg.MODEL.WEIGHTS:
        raise ConfigError("MODEL.WEIGHTS must name a checkpoint: test_net.py refuses to run without weights")
    check_dataset_paths(cfg)
    model_source(cfg.MODEL.ARCH)
    env, writer = setup_environment(cfg, training=False)
    try:
        model = build_model_for(cfg, env)
        state = load_weights(model, cfg.MODEL.WEIGHTS, cfg.MODEL.WEIGHTS_KIND, arch=cfg.MODEL.ARCH)
        if not state.get("classes"):
            logger.warning("%s names no classes: the folders' sorted order is taken as the model's", cfg.MODEL.WEIGHTS)
        warn_if_evaluated_otherwise(state, cfg, cfg.MODEL.WEIGHTS)
        val = build_val_split(cfg, env, state.get("classes"))
        if cfg.TRAIN.COMPILE:
            model = torch.compile(model)
        totals = validate(model, val, cfg, env)
        epoch = int(state.get("epoch", 0)) if isinstance(state.get("epoch"), int) else 0
        write_eval_record(writer, "test", epoch, totals, cfg.TRAIN.TOPK, cfg.MODEL.WEIGHTS_KIND)
        logger.info(
            "test %s: top1 %.3f  top%d %.3f  loss %.4f  (%d images); recorded in %s/metrics.jsonl",
            cfg.MODEL.WEIGHTS, totals["top1_acc"], cfg.TRAIN.TOPK, totals["topk_acc"], totals["loss"], totals["samples"],
            cfg.OUT_DIR,
        )  # fmt: skip
        return totals
    finally:
        writer.close()
        cleanup_distributed()


test_model.__test__ = False  # a library entry point, not a pytest test
