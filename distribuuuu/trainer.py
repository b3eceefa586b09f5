"""The training algorithm, top-down: train_model -> train_run -> train_epochs -> train_one_epoch ->
train_epoch -> train_step -> optimizer_step.

Everything else has its own home: the session a run lives in (``training/session.py``: the process
group, OUT_DIR and its lock, logging), the run's assembly (``training/run.py``) and state
(``training/state.py``), what a checkpoint holds and resuming it (``training/components.py``,
``training/resume.py``), evaluation (``training/evaluation.py``), the task (``training/task.py``),
autocast and gradient sync (``runtime/parallel.py``), the records (``records/``).
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.logger import get_logger
from distribuuuu.records.meters import MetricSums
from distribuuuu.records.writer import log_train_window, write_train_record
from distribuuuu.runtime.faults import check_finite, collective_error, is_comm_failure
from distribuuuu.runtime.parallel import autocast, gradient_sync, norm_value, to_device
from distribuuuu.runtime.preemption import stop_for_preemption
from distribuuuu.training.evaluation import check_inputs, evaluate_epoch, test_model, validate
from distribuuuu.training.optim import lr_at, set_lr
from distribuuuu.training.parallelize import agree_on_buffers
from distribuuuu.training.preprocessing import progressive
from distribuuuu.training.resume import (
    ResumePoint,
    find_checkpoint_to_resume,
    log_config_changes,
    resume_or_load_weights,
    save_training_checkpoint,
)
from distribuuuu.training.run import build_run
from distribuuuu.training.session import Session
from distribuuuu.training.state import Run, Window

__all__ = ["test_model", "train_epoch", "train_model", "train_one_epoch", "train_step", "validate"]

logger = get_logger("trainer")


# --- The run ------------------------------------------------------------
def train_model(cfg: CfgNode, cleanup: bool = True) -> dict:
    """Train MODEL.ARCH as configured; return the last validation totals.

    ``cleanup`` False keeps the process group for a caller that trains several times in one job;
    otherwise every way out (a refused resume included) ends it before returning or raising.
    """
    check_inputs(cfg)  # dataset folders and the architecture: before any set-up
    with Session(cfg, cleanup=cleanup) as session:  # the process group and OUT_DIR's lock
        # Before anything is written to OUT_DIR: a checkpoint of another experiment stops the run here.
        resume = session.decide(lambda: find_checkpoint_to_resume(cfg, session.checkpoints))
        if resume.epochs_done >= cfg.OPTIM.MAX_EPOCH:
            session.report_finished(resume.epochs_done)  # a finished run is read, not written
            return {}
        return train_run(session, resume)


def train_run(session: Session, resume: ResumePoint) -> dict:
    """Build the run, put it where it stopped, open its outputs, train it and summarise it."""
    session.prepare()
    log_config_changes(resume.path, resume.changes)
    with session.watching():  # a failed collective or a stalled rank is named with the run's position
        run = session.follow(build_run(session.cfg, session.env))
        resume_or_load_weights(run, session.checkpoints, resume.path)
        session.open_outputs(
            resume.path, resume.epochs_done
        )  # only now: bad data, batch or weights left OUT_DIR as it was
        with session.preemptible():
            last_val = train_epochs(run, session)
        session.writer.summarize()  # rank 0 (the others hold a NullWriter): summary.md and the plot
    return last_val


def train_epochs(run: Run, session: Session) -> dict:
    """From the resumed epoch on: train, agree on BatchNorm statistics, evaluate, checkpoint."""
    cfg, last_val, first_epoch = run.cfg, {}, run.state.epoch
    with session.checkpoints.writing():  # the run ends (or fails) with its last checkpoint written
        for epoch in range(first_epoch, cfg.OPTIM.MAX_EPOCH):
            train_one_epoch(run, session, epoch)
            is_best = False
            if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or epoch + 1 == cfg.OPTIM.MAX_EPOCH:
                last_val, is_best = evaluate_epoch(run, session.writer, session.checkpoints.path(epoch + 1), epoch)
            save_training_checkpoint(run, session.checkpoints, is_best, background=True)
            if cfg.TRAIN.STOP_AFTER_EPOCHS and epoch + 1 - first_epoch >= cfg.TRAIN.STOP_AFTER_EPOCHS:
                break
    return last_val


def train_one_epoch(run: Run, session: Session, epoch: int) -> dict:
    """Train ``epoch`` from the run's position, agree on BatchNorm statistics, record it, and move
    the run to the next epoch's start: an epoch of train_net.py, less evaluation and checkpoint."""
    schedule = progressive(run.cfg)
    im_size = schedule.size_at(epoch)  # the epoch's crop: progressive resizing's, else TRAIN.IM_SIZE
    if schedule.on:
        logger.info("epoch %d/%d trains at %d px (progressive resizing)", epoch + 1, run.cfg.OPTIM.MAX_EPOCH, im_size)
    run.telemetry.at_size(im_size)  # its FLOPs a training image, for TFLOP/s and MFU
    totals = train_epoch(run, session, epoch) | run.telemetry.end_epoch()  # the ranks' times over the epoch
    agree_on_buffers(run.model, run.ema)
    fp16 = run.scaler.is_enabled()
    lr = scheduled_lr(run)
    write_train_record(
        session.writer, epoch + 1, totals, run.task.reported_k(run.cfg.TRAIN.TOPK), lr, run.global_step, fp16, im_size
    )
    run.move_to(epoch + 1)
    return totals


# --- An epoch ------------------------------------------------------------
def train_epoch(run: Run, session: Session, epoch: int) -> dict:
    """Train one epoch (from run.state.step_in_epoch on); return the epoch's reduced totals (a resumed
    epoch's include its checkpoint's: ``run.epoch_totals``).

    Metrics stay on the device between synchronisation points: every PRINT_FREQ steps, at a
    mid-epoch checkpoint and at the last step, one all-reduce carries the metrics, the preemption
    flag and the non-finite count. No other step syncs the host or talks to the other ranks.
    """
    t = run.cfg.TRAIN
    start, end = start_epoch_sampler(run, epoch)
    run.forward_model.train()
    run.epoch_totals.begin(start)  # a resumed epoch goes on from its checkpoint's sums
    batches, window = iter(run.train.loader), Window(run.env.device, t.TOPK, run.env.world_size)
    for step in range(start, end):
        micro_batches = window.next_batches(batches, t.ACCUM_STEPS)
        set_lr(run.optimizer, lr_at(run.schedule_step, run.steps_per_epoch, run.cfg.OPTIM, run.base_lr))
        window.losses.append(guarded_step(run, micro_batches, window.sums, epoch, step))
        run.state.step_in_epoch = step + 1
        run.state.samples_in_epoch += run.global_batch
        checkpoint_due = bool(t.CKPT_PERIOD_ITERS) and (step + 1) % t.CKPT_PERIOD_ITERS == 0 and step + 1 < end
        if (step + 1) % t.PRINT_FREQ == 0 or step + 1 == end or checkpoint_due:  # a checkpoint's weights pass the check
            sync_point(run, session, window, epoch, step + 1, end)
        if checkpoint_due:
            save_training_checkpoint(run, session.checkpoints, background=True)
    return run.epoch_totals.totals()


def start_epoch_sampler(run: Run, epoch: int) -> tuple[int, int]:
    """Point the train sampler at the epoch's resumed position; return the range of step numbers to run.

    Steps count the optimizer steps (checkpoint names, EMA period); the sampler and the LR follow
    the global sample position. Resumed with another global batch, the epoch continues at the saved
    position and ends when fewer samples than one global batch are left, as drop_last ends every epoch.
    """
    sampler, start, rank_batch = run.train.sampler, run.state.step_in_epoch, run.global_batch // run.env.world_size
    sampler.set_epoch(epoch)
    sampler.set_position(run.state.samples_in_epoch)
    return start, start + len(sampler) // rank_batch


def sync_point(run: Run, session: Session, window: Window, epoch: int, step: int, end: int) -> dict:
    """Reduce the window's metrics over ranks (one all-reduce), check, log, add them to the epoch's and
    reset them; stop here if a rank was asked to (preemption, Ctrl-C), a checkpoint on disk first.
    ``step``: the step just taken; ``end``: the epoch's last (another global batch's resume
    continues the saved numbers)."""
    preempt = session.preempt
    stop, interrupt = (preempt.requested, preempt.interrupted) if preempt is not None else (False, False)
    try:  # the metrics, the stop flags, every rank's step time and data wait: one all-reduce
        totals = window.reduce(run.env.rank, stop, interrupt)
    except RuntimeError as e:
        what = f"metrics all-reduce at epoch {epoch + 1}, step {step}"
        raise collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S) from e
    check_finite(totals, window.losses, epoch, step, run.cfg.TRAIN.NAN_POLICY)
    log_window(run, session, window, totals, epoch, step, end)
    window.reset()
    run.epoch_totals.add(totals)  # before a stop's checkpoint, which keeps them
    if totals["stop"]:
        save = functools.partial(save_training_checkpoint, run, session.checkpoints)  # on disk before the exit
        stop_for_preemption(preempt, run.position(), save, run.cfg.DIST.REQUEUE, interrupted=bool(totals["interrupt"]))
    return totals


def log_window(run: Run, session: Session, window: Window, totals: dict, epoch: int, step: int, end: int) -> None:
    """The window's log line (loss, accuracy, LR, speed, data wait, ETA, the ranks' step times, MFU) and its curves."""
    steps_left = end - step + (run.cfg.OPTIM.MAX_EPOCH - epoch - 1) * run.steps_per_epoch
    elapsed_s, hosts = time.perf_counter() - window.started, [row["host"] for row in session.table]
    telemetry = run.telemetry.window(totals, elapsed_s, len(window.losses), f"epoch {epoch + 1}, step {step}", hosts)
    log_train_window(
        session.writer, totals, epoch, step, run.cfg.OPTIM.MAX_EPOCH, run.task.reported_k(run.cfg.TRAIN.TOPK), end,
        lr=scheduled_lr(run), elapsed_s=elapsed_s, data_s=window.data_s, steps=len(window.losses),
        steps_left=steps_left, fp16=run.scaler.is_enabled(), global_step=run.global_step, telemetry=telemetry,
    )  # fmt: skip


def scheduled_lr(run: Run) -> float:
    """The schedule's LR of the last step taken: what the log shows (a group's LR is it x its lr_scale)."""
    return lr_at(max(run.schedule_step - 1, 0), run.steps_per_epoch, run.cfg.OPTIM, run.base_lr)


# --- A step ------------------------------------------------------------
def guarded_step(run: Run, micro_batches: list, sums: MetricSums, epoch: int, step: int) -> torch.Tensor:
    """``train_step``; a failed collective is named with the rank, epoch and step (and the stalled peers)."""
    try:
        return train_step(run, micro_batches, sums)
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise  # a bug in the model or the step: its traceback is what the user needs
        what = f"training step (forward, backward, gradient all-reduce) at epoch {epoch + 1}, step {step + 1}"
        raise collective_error(e, run.env.rank, run.env.world_size, what, run.cfg.DIST.TIMEOUT_S) from e


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
    run.scaler.unscale_(run.optimizer)  # no-op unless fp16: clipping must see the true gradients
    grad_norm = gradient_norm(run)
    if run.scaler.is_enabled():
        # GradScaler skips exactly the steps whose unscaled gradients hold an inf or NaN, which is
        # when their norm is not finite: counted on the device, with no host sync (get_scale()
        # would copy the scale to the host every step).
        sums.add_once("skipped_steps", ~torch.isfinite(grad_norm))
        run.scaler.step(run.optimizer)
        run.scaler.update()
    elif run.cfg.TRAIN.NAN_POLICY == "skip" and not torch.isfinite(grad_norm).item():
        # With NAN_POLICY "skip" the step needs the norm on the host: that one sync is its price.
        sums.add_once("skipped_steps", 1)
        run.optimizer.zero_grad(set_to_none=True)
        return
    else:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None and (run.global_step + 1) % run.cfg.OPTIM.EMA_PERIOD == 0:
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
