"""The training algorithm: train_model -> train_epochs -> train_one_epoch -> train_epoch -> train_step.

Everything else has its own home: the run's set-up (``training/run.py``), what a checkpoint holds and
resuming it (``training/components.py``, ``training/resume.py``), evaluation (``training/evaluation.py``:
validate, test_model), autocast and gradient sync (``runtime/parallel.py``), the records (``records/``),
preemption, RNG and fault handling.
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import BEST_METRICS, check_dataset_paths, global_batch
from distribuuuu.data.progressive import progressive_on, train_size
from distribuuuu.logger import get_logger
from distribuuuu.models import model_source
from distribuuuu.records.meters import MetricSums
from distribuuuu.records.out_dir_lock import OutDirLock, is_a_restart
from distribuuuu.records.writer import (
    log_train_window,
    multilabel_text,
    reported_k,
    topk_text,
    write_eval_record,
    write_train_record,
)
from distribuuuu.runtime.faults import check_finite, collective_error, is_comm_failure, naming_failed_collectives
from distribuuuu.runtime.heartbeat import reporting_position
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import autocast, gradient_sync, norm_value, to_device
from distribuuuu.runtime.preemption import PreemptionHandler, stop_for_preemption
from distribuuuu.runtime.process_group import broadcast_buffers, cleanup_distributed, rank0_decides
from distribuuuu.training.evaluation import precise_bn, test_model, validate
from distribuuuu.training.optim import lr_at, set_lr
from distribuuuu.training.resume import (
    ResumePoint,
    find_checkpoint_to_resume,
    log_config_changes,
    resume_or_load_weights,
    save_training_checkpoint,
    writing_checkpoints,
)
from distribuuuu.training.run import (
    Run,
    TrainState,
    build_run,
    open_outputs,
    prepare_process,
    report_finished_run,
    start_process_group,
)

__all__ = ["test_model", "train_epoch", "train_model", "train_one_epoch", "train_step", "validate"]

logger = get_logger("trainer")


# ------------------------------------------------------------------------------------------------
# One optimizer step
# ------------------------------------------------------------------------------------------------
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
            loss = training_loss(run, images, logits, soft_targets)
        run.scaler.scale(loss / len(micro_batches)).backward()
        sums.add(loss, logits, targets)
        if skipped:
            sums.add_field("skipped_images", skipped)
        losses.append(loss.detach())
    optimizer_step(run, sums)
    return torch.stack(losses).mean()


def training_loss(run: Run, images: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The criterion on the student's logits; with DISTILL.TEACHER, mixed with the teacher's on the same (mixed) images."""
    if run.teacher is None:
        return run.criterion(logits.float(), targets)
    return run.criterion(logits.float(), targets, run.teacher(images).float())


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
            totals = sync_point(run, window, window_losses, epoch, step + 1, end, clock)
            epoch_sums.add_totals(totals)
            if totals["stop"]:
                position = f"epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}"
                save = functools.partial(save_training_checkpoint, run)  # on disk before the exit
                stop_for_preemption(
                    run.preempt, position, save, cfg.DIST.REQUEUE, interrupted=bool(totals["interrupt"])
                )
        if checkpoint_due:
            save_training_checkpoint(run, background=True)
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
        sampler.set_start(start * global_batch(t))
        return start, run.steps_per_epoch
    sampler.set_position(run.state.samples_in_epoch)
    return start, start + len(sampler) // global_batch(t)


def _with_context(e: RuntimeError, run: Run, epoch: int, step: int) -> RuntimeError:
    """Name the rank, epoch and step of a failed step, and the stalled peers of a failed all-reduce."""
    what = f"training step (forward, backward, gradient all-reduce) at epoch {epoch + 1}, step {step + 1}"
    return collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S)


def sync_point(run: Run, window: MetricSums, window_losses: list, epoch: int, step: int, end: int, clock: dict) -> dict:
    """Reduce the window's metrics over ranks (one all-reduce), check them, log them, reset.

    ``step``: the step just taken; ``end``: the epoch's last, steps_per_epoch except in an epoch
    resumed with another global batch, whose step numbers go on from the checkpoint's.
    """
    window.add_field("stop", float(run.preempt is not None and run.preempt.requested))
    window.add_field("interrupt", float(run.preempt is not None and run.preempt.interrupted))
    try:
        totals = window.reduce()
    except RuntimeError as e:
        what = f"metrics all-reduce at epoch {epoch + 1}, step {step}"
        raise collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S) from e
    check_finite(totals, window_losses, epoch, step, run.cfg.TRAIN.NAN_POLICY)
    elapsed = time.perf_counter() - clock["start"]
    steps_left = end - step + (run.cfg.OPTIM.MAX_EPOCH - epoch - 1) * run.steps_per_epoch
    log_train_window(
        run.writer, totals, epoch, step, run.cfg, end, lr=scheduled_lr(run),
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


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def train_model(cfg: CfgNode, cleanup: bool = True) -> dict:
    """Train MODEL.ARCH as configured; return the last validation totals.

    ``cleanup`` False keeps the process group for a caller that trains several times in one job;
    otherwise every way out (a refused resume included) ends it before returning or raising.
    """
    check_dataset_paths(cfg)
    model_source(cfg.MODEL.ARCH)  # an unknown architecture fails before any set-up
    env, table = start_process_group(cfg)
    lock = out_dir_lock(cfg) if env.is_main_process else None
    try:
        rank0_decides(lambda: lock.acquire())  # before OUT_DIR is read: another run holding it stops this one
        # Before anything is written to OUT_DIR: a checkpoint of another experiment stops the run here.
        resume = rank0_decides(lambda: find_checkpoint_to_resume(cfg))
        if resume.epochs_done >= cfg.OPTIM.MAX_EPOCH:
            report_finished_run(cfg, env, resume.epochs_done)  # a finished run is read, not written
            return {}
        return _train(cfg, env, table, resume)
    finally:
        if lock is not None:
            lock.release()
        if cleanup:
            cleanup_distributed()


def out_dir_lock(cfg: CfgNode) -> OutDirLock:
    """The lock of this run's OUT_DIR: a requeued or restarted job waits for its predecessor to let go."""
    return OutDirLock(cfg.OUT_DIR, cfg.DIST.LOCK_STALE_S, cfg.DIST.LOCK_WAIT_S if is_a_restart() else 0.0)


def _train(cfg: CfgNode, env: DistEnv, table: list[dict], resume: ResumePoint) -> dict:
    """Build the run, resume it, open its outputs and train it (``train_model``'s body)."""
    prepare_process(cfg, env, table)
    log_config_changes(resume.path, resume.changes)
    run: Run | None = None
    writer = None
    try:
        with naming_failed_collectives(env, cfg.DIST.TIMEOUT_S, lambda: run.state if run else TrainState()):
            run = build_run(cfg, env, writer)
            with reporting_position(lambda: f"epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}"):
                resume_or_load_weights(run, resume.path)
                # Only now is OUT_DIR written: bad data, batch size or weights left it as it was.
                run.writer = writer = open_outputs(cfg, env, table, resumed_from=resume.path)
                with PreemptionHandler(cfg.DIST.PREEMPT_GRACE_S) as run.preempt:
                    last_val = train_epochs(run)
                run.writer.summarize()  # rank 0 (the others hold a NullWriter): summary.md and the plot
            return last_val
    finally:
        if writer is not None:
            writer.close()
        run = None  # its model holds the process group: let it go with the group, not at interpreter exit


def train_epochs(run: Run) -> dict:
    """From the resumed epoch on: train, agree on BatchNorm statistics, evaluate, checkpoint."""
    cfg, last_val, first_epoch = run.cfg, {}, run.state.epoch
    with writing_checkpoints(run):  # the run ends (or fails) with its last checkpoint written
        for epoch in range(first_epoch, cfg.OPTIM.MAX_EPOCH):
            train_one_epoch(run, epoch)
            is_best = False
            if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or epoch + 1 == cfg.OPTIM.MAX_EPOCH:
                last_val, is_best = evaluate_epoch(run, epoch)
            save_training_checkpoint(run, is_best, background=True)
            if cfg.TRAIN.STOP_AFTER_EPOCHS and epoch + 1 - first_epoch >= cfg.TRAIN.STOP_AFTER_EPOCHS:
                break
    return last_val


def train_one_epoch(run: Run, epoch: int) -> dict:
    """Train ``epoch`` from the run's position, agree on BatchNorm statistics, record it, and move
    the run to the next epoch's start: an epoch of train_net.py, less evaluation and checkpoint."""
    im_size = train_size(epoch, run.cfg.TRAIN)  # the epoch's crop: progressive resizing's, else TRAIN.IM_SIZE
    if progressive_on(run.cfg.TRAIN):
        logger.info("epoch %d/%d trains at %d px (progressive resizing)", epoch + 1, run.cfg.OPTIM.MAX_EPOCH, im_size)
    totals = train_epoch(run, epoch)
    sync_buffers(run)
    write_train_record(
        run.writer, epoch + 1, totals, reported_k(run.cfg), scheduled_lr(run), run.global_step, run.scaler.is_enabled(),
        im_size,
    )  # fmt: skip
    run.move_to(epoch + 1)
    return totals


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
    """Recompute BatchNorm statistics (BN.PRECISE_IMAGES), validate the raw weights (and the EMA
    weights) on val and TEST.EXTRA_DATASETS; update the best (from val only); log and record each."""
    if run.precise_bn is not None:  # BN.PRECISE_IMAGES: the same statistics on every rank, then saved
        precise_bn(
            {"model": run.model} | ({"ema": run.ema.module} if run.ema else {}), run.precise_bn, run.cfg, run.env
        )
    candidates = [("model", run.eval_model)] + ([("ema", run.ema.module)] if run.ema is not None else [])
    is_best, results = False, {}
    for split_name, split in [("val", run.val), *run.extra_val.items()]:
        for name, module in candidates:
            prefix = split_name + ("_ema" if name == "ema" else "")
            totals = validate(module, split, run.cfg, run.env, (os.path.join(run.cfg.OUT_DIR, "evaluation"), prefix))
            k = reported_k(run.cfg)
            write_eval_record(run.writer, split_name, epoch + 1, totals, k, name)
            logger.info(
                "%s %s epoch %d: loss %.4f  top1 %.2f%s%s  (%d images, %.0f img/s)",
                split_name, name, epoch + 1, totals["loss"], totals["top1_acc"], topk_text(k, totals["topk_acc"]),
                multilabel_text(totals), totals["samples"], totals["images_per_s"],
            )  # fmt: skip
            if split_name != "val":
                continue
            results[name] = totals
            if improves_best(run.state, totals, run.cfg.TRAIN.BEST_METRIC):
                field, _ = BEST_METRICS[run.cfg.TRAIN.BEST_METRIC]
                value = totals["top1_acc" if field == "top1" else field]
                run.state.best_acc1, run.state.best_value, run.state.best_weights = totals["top1_acc"], value, name
                is_best = True
    return results["model"], is_best


def improves_best(state: TrainState, totals: dict, metric: str) -> bool:
    """Whether an evaluation beats the best so far by TRAIN.BEST_METRIC (top-1 as always: above the best)."""
    if metric == "top1":
        return totals["top1_acc"] > state.best_acc1
    field, lower_is_better = BEST_METRICS[metric]
    if state.best_value is None:
        return True
    return totals[field] < state.best_value if lower_is_better else totals[field] > state.best_value
