"""Evaluation: ``validate`` (every sample exactly once across ranks) and ``test_model`` (tools/test_net.py)."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import ConfigError
from distribuuuu.data import Split, sample_paths
from distribuuuu.logger import get_logger
from distribuuuu.models import model_source
from distribuuuu.records.eval_outputs import EvalOutputs
from distribuuuu.records.meters import MetricSums
from distribuuuu.records.writer import multilabel_text, topk_text, write_eval_record
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import autocast, is_sharded, missing_forwards, to_device
from distribuuuu.training.inputs import build_precise_bn_split, build_val_split, check_data
from distribuuuu.training.parallelize import build_model_for
from distribuuuu.training.precise_bn import recompute_bn_stats
from distribuuuu.training.preprocessing import eval_crop_size
from distribuuuu.training.resume import load_configured_weights, warn_if_evaluated_otherwise
from distribuuuu.training.session import Session
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


def precise_bn(models: dict[str, nn.Module], split: Split, cfg: CfgNode, env: DistEnv) -> None:
    """Recompute each model's BatchNorm running statistics over BN.PRECISE_IMAGES training images
    (precise_bn.py), summed exactly across ranks; log what it cost. A collective: every rank calls it."""

    def batches():
        for images, _, _ in split.loader:  # on the device already (DeviceLoader)
            yield images.contiguous(memory_format=torch.channels_last) if cfg.TRAIN.CHANNELS_LAST else images

    for name, model in models.items():
        tic = time.perf_counter()
        context = functools.partial(autocast, cfg.TRAIN.PRECISION, env.device)
        images = recompute_bn_stats(model, batches(), forward_context=context)
        logger.info(
            "precise BN (%s weights): BatchNorm statistics recomputed over %d training images (%s transform) in %.1f s",
            name, images, cfg.BN.PRECISE_TRANSFORM, time.perf_counter() - tic,
        )  # fmt: skip


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
    """Evaluate MODEL.WEIGHTS on the val split; append a ``test`` line to OUT_DIR/metrics.jsonl.

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
        totals = evaluate_weights(model, val, bn_split, cfg, session.env)
        epoch = int(state.get("epoch", 0)) if isinstance(state.get("epoch"), int) else 0
        k = build_task(cfg.MODEL, cfg.TEST).reported_k(cfg.TRAIN.TOPK)
        write_eval_record(writer, "test", epoch, totals, k, cfg.MODEL.WEIGHTS_KIND)
        logger.info(
            "test %s: top1 %.3f%s%s  loss %.4f  (%d images); recorded in %s/metrics.jsonl",
            cfg.MODEL.WEIGHTS, totals["top1_acc"], topk_text(k, totals["topk_acc"], 3), multilabel_text(totals, 3),
            totals["loss"], totals["samples"], cfg.OUT_DIR,
        )  # fmt: skip
        return totals


def evaluate_weights(model: nn.Module, val: Split, bn_split: Split | None, cfg: CfgNode, env: DistEnv) -> dict:
    """test_net.py's evaluation: precise BN first (BN.PRECISE_IMAGES), compiled (TRAIN.COMPILE), then validated."""
    if bn_split is not None:
        precise_bn({cfg.MODEL.WEIGHTS_KIND: model}, bn_split, cfg, env)
    if cfg.TRAIN.COMPILE:
        model = torch.compile(model)
    return validate(model, val, cfg, env)


test_model.__test__ = False  # a library entry point, not a pytest test
