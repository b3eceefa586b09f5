"""Evaluation: ``validate`` (every sample exactly once across ranks) and ``test_model`` (tools/test_net.py)."""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.checkpointing.checkpoint import model_state_from, weights_digest
from distribuuuu.config import ConfigError
from distribuuuu.data import Split, sample_paths
from distribuuuu.logger import get_logger
from distribuuuu.models import model_source
from distribuuuu.records.eval_outputs import EvalOutputs
from distribuuuu.records.meters import MetricSums
from distribuuuu.records.writer import (
    checkpoint_field,
    evaluation_line,
    multilabel_text,
    topk_text,
    tta_text,
    write_eval_record,
)
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import autocast, is_sharded, missing_forwards, to_device
from distribuuuu.training.inputs import build_precise_bn_split, build_val_split, check_data
from distribuuuu.training.parallelize import build_model_for
from distribuuuu.training.precise_bn import recompute_bn_stats
from distribuuuu.training.preprocessing import eval_crop_size
from distribuuuu.training.resume import load_configured_weights, warn_if_evaluated_otherwise
from distribuuuu.training.session import Session
from distribuuuu.training.state import Run
from distribuuuu.training.task import Task, build_task

logger = get_logger("trainer")  # the name the evaluation lines have always carried


@torch.no_grad()
def validate(
    model: nn.Module,
    split: Split,
    cfg: CfgNode,
    env: DistEnv,
    task: Task | None = None,
    outputs: tuple[str, str] | None = None,
) -> dict:
    """Evaluate every val sample exactly once across ranks; return exact totals and means.

    With ``outputs`` (folder, file prefix), TEST.CONFUSION's and TEST.SAVE_PREDICTIONS's files are
    saved there: one more all-reduce and one gather per evaluation, none per batch.
    """
    model.eval()
    t, task = cfg.TEST, task or build_task(cfg.MODEL, cfg.TEST)
    sums = MetricSums(env.device, cfg.TRAIN.TOPK)
    labels = task.label_sums(env.device)  # MODEL.TASK multilabel: mAP and F1 counts (records/multilabel.py)
    names = split.classes + [str(c) for c in range(len(split.classes), cfg.MODEL.NUM_CLASSES)]
    extras = EvalOutputs(len(names), cfg.TRAIN.TOPK, env.device, t.CONFUSION, t.SAVE_PREDICTIONS) if outputs else None
    tic = time.perf_counter()
    # A sharded model all-gathers in every forward: ranks with fewer batches owe empty forwards,
    # counted before the loop (a count taken after it would meet a peer's all-gather: deadlock).
    owed = missing_forwards(len(split.loader), env.device) if is_sharded(model) else 0
    for i, (images, targets, skipped) in enumerate(split.loader):
        images, targets = to_device(images, targets, env, cfg.TRAIN.CHANNELS_LAST)
        with autocast(cfg.TRAIN.PRECISION, env.device):
            logits = tta_forward(model, images, t.TTA)
        sums.add(task.val_loss(logits.float(), targets), logits, targets)
        if labels is not None:
            labels.add(logits, targets)
        if extras is not None:
            extras.update(logits, targets, skipped)
        if skipped:
            sums.add_field("skipped_images", skipped)
        if (i + 1) % cfg.TEST.PRINT_FREQ == 0:
            logger.info("val  batch %d/%d (rank 0)", i + 1, len(split.loader))
    run_empty_forwards(model, owed, cfg, env)
    totals = sums.reduce() | (labels.reduce() if labels is not None else {})
    if extras is not None:
        extras.save(*outputs, indices=list(split.sampler), paths=sample_paths(split.dataset), names=names)
    totals["time_s"] = time.perf_counter() - tic
    totals["images_per_s"] = totals["samples"] / max(totals["time_s"], 1e-9)
    if t.TTA:
        totals["tta"] = t.TTA  # its record and log line say so: a flip-TTA score is another measurement
    return totals


def tta_forward(model: nn.Module, images: torch.Tensor, tta: str = "") -> torch.Tensor:
    """The model's logits of ``images``; with TEST.TTA flip, the mean of the image's and its horizontal
    flip's logits (as timm's ``--tta`` averages the logits of its copies), in float32.

    One forward of both halves: a sharded model joins one all-gather per batch either way, so the
    ranks' empty forwards (``run_empty_forwards``) still match their batches.
    """
    if tta != "flip":
        return model(images)
    logits = model(torch.cat([images, images.flip(-1)])).float()
    return (logits[: len(images)] + logits[len(images) :]) / 2


def precise_bn(models: dict[str, nn.Module], split: Split, cfg: CfgNode, env: DistEnv) -> float:
    """Recompute each model's BatchNorm running statistics over BN.PRECISE_IMAGES training images
    (precise_bn.py), summed exactly across ranks; log what it cost and return its seconds. A
    collective: every rank calls it."""

    def batches():
        for images, _, _ in split.loader:  # on the device already (DeviceLoader)
            yield images.contiguous(memory_format=torch.channels_last) if cfg.TRAIN.CHANNELS_LAST else images

    started = time.perf_counter()
    for name, model in models.items():
        tic = time.perf_counter()
        context = functools.partial(autocast, cfg.TRAIN.PRECISION, env.device)
        images = recompute_bn_stats(model, batches(), forward_context=context)
        logger.info(
            "precise BN (%s weights): BatchNorm statistics recomputed over %d training images (%s transform) in %.1f s",
            name, images, cfg.BN.PRECISE_TRANSFORM, time.perf_counter() - tic,
        )  # fmt: skip
    return time.perf_counter() - started


def evaluate_epoch(run: Run, writer, checkpoint: str, epoch: int) -> tuple[dict, bool]:
    """Recompute BatchNorm statistics (BN.PRECISE_IMAGES), validate the raw weights (and the EMA
    weights) on val and TEST.EXTRA_DATASETS, record each naming ``checkpoint`` (written next, it holds
    them); the best is chosen from val alone. Returns the raw weights' val totals and whether they
    (or the EMA's) are the new best."""
    precise_s = epoch_precise_bn(run)
    weights = {"model": run.eval_model} | ({"ema": run.ema.module} if run.ema is not None else {})
    held = held_weights(run, checkpoint, epoch + 1)
    folder, k = os.path.join(run.cfg.OUT_DIR, "evaluation"), run.task.reported_k(run.cfg.TRAIN.TOPK)
    is_best, val = False, {}
    for split_name, split in [("val", run.val), *run.extra_val.items()]:
        for name, module in weights.items():
            prefix = split_name + ("_ema" if name == "ema" else "")
            totals = validate(module, split, run.cfg, run.env, run.task, (folder, prefix))
            improved = split_name == "val" and run.best.improves(totals)
            if improved:
                run.best.take(totals, name)
            best = run.best.metric if improved else None
            write_eval_record(writer, split_name, epoch + 1, totals, k, name, best, held[name], precise_s)
            precise_s = None  # the epoch's precise BN is recorded once, with its first evaluation
            logger.info("%s", evaluation_line(f"{split_name} {name} epoch {epoch + 1}", totals, k))
            is_best |= improved
            val = totals if (split_name, name) == ("val", "model") else val
    return val, is_best


def epoch_precise_bn(run: Run) -> float | None:
    """BN.PRECISE_IMAGES: the same BatchNorm statistics on every rank (raw and EMA weights), then
    saved with them; its seconds, or None without it."""
    if run.precise_bn is None:
        return None
    models = {"model": run.model} | ({"ema": run.ema.module} if run.ema is not None else {})
    return precise_bn(models, run.precise_bn, run.cfg, run.env)


def held_weights(run: Run, checkpoint: str, epoch: int) -> dict[str, dict]:
    """The checkpoint field of each weights evaluated (raw, EMA): ``checkpoint``, ``epoch`` and, on
    rank 0 (the one that records), their SHA-256; none under sharding, where no rank holds them whole."""
    modules = {"model": run.model} | ({"ema": run.ema.module} if run.ema is not None else {})
    whole = run.env.is_main_process and not is_sharded(run.model)
    return {
        name: checkpoint_field(checkpoint, epoch, weights_digest(module.state_dict()) if whole else None)
        for name, module in modules.items()
    }


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


def check_inputs(cfg: CfgNode) -> None:
    """Name a dataset folder that is not there, a decoder not installed, or an unknown MODEL.ARCH,
    before any process set-up."""
    check_data(cfg)
    model_source(cfg.MODEL.ARCH)


def test_model(cfg: CfgNode) -> dict:
    """Evaluate MODEL.WEIGHTS on the val split; append a ``test`` line naming it to OUT_DIR/metrics.jsonl
    (test_net.py's OUT_DIR: its own folder beside the checkpoint unless given, stored_config.py).

    OUT_DIR's config.yaml is left alone: evaluating into a training run's folder keeps its record.
    """
    if not cfg.MODEL.WEIGHTS:
        raise ConfigError("MODEL.WEIGHTS must name a checkpoint: test_net.py refuses to run without weights")
    check_inputs(cfg)
    with Session(cfg, training=False) as session:
        session.prepare()
        model = build_model_for(cfg, session.env)
        state = load_configured_weights(model, cfg, arch=cfg.MODEL.ARCH)
        if not state.get("classes"):
            logger.warning("%s names no classes: the folders' sorted order is taken as the model's", cfg.MODEL.WEIGHTS)
        warn_if_evaluated_otherwise(state, cfg, cfg.MODEL.WEIGHTS)
        val = build_val_split(cfg, session.env, state.get("classes"))
        bn_split = build_precise_bn_split(cfg, session.env) if cfg.BN.PRECISE_IMAGES else None
        # Only now is OUT_DIR written: weights that do not fit or a bad val set left it as it was.
        writer = session.open_outputs()
        totals, precise_s = evaluate_weights(model, val, bn_split, cfg, session.env)
        k = build_task(cfg.MODEL, cfg.TEST).reported_k(cfg.TRAIN.TOPK)
        write_test_record(writer, cfg, state, totals, k, precise_s)
        logger.info(
            "test %s: top1 %.3f%s%s  loss %.4f  (%d images%s); recorded in %s/metrics.jsonl",
            cfg.MODEL.WEIGHTS, totals["top1_acc"], topk_text(k, totals["topk_acc"], 3), multilabel_text(totals, 3),
            totals["loss"], totals["samples"], tta_text(totals), cfg.OUT_DIR,
        )  # fmt: skip
        return totals


def write_test_record(writer, cfg: CfgNode, state: dict, totals: dict, k: int | None, precise_s: float | None) -> None:
    """The ``test`` line of MODEL.WEIGHTS (``state``, as loaded): its epoch, and the checkpoint named by
    its path and the SHA-256 of the weights evaluated (MODEL.WEIGHTS_KIND's, as the file holds them)."""
    epoch = int(state.get("epoch", 0)) if isinstance(state.get("epoch"), int) else 0
    digest = weights_digest(model_state_from(state, cfg.MODEL.WEIGHTS_KIND))
    named = checkpoint_field(cfg.MODEL.WEIGHTS, epoch, digest)
    write_eval_record(writer, "test", epoch, totals, k, cfg.MODEL.WEIGHTS_KIND, None, named, precise_s)


def evaluate_weights(
    model: nn.Module, val: Split, bn_split: Split | None, cfg: CfgNode, env: DistEnv
) -> tuple[dict, float | None]:
    """test_net.py's evaluation: precise BN first (BN.PRECISE_IMAGES), compiled (TRAIN.COMPILE), then
    validated; its totals, and precise BN's seconds (None without it)."""
    precise_s = precise_bn({cfg.MODEL.WEIGHTS_KIND: model}, bn_split, cfg, env) if bn_split is not None else None
    if cfg.TRAIN.COMPILE:
        model = torch.compile(model)
    return validate(model, val, cfg, env), precise_s


test_model.__test__ = False  # a library entry point, not a pytest test
