"""Knowledge distillation's teacher (DISTILL.TEACHER): loaded frozen from a checkpoint, named by its
weights' hash, called on the student's (mixed) images without gradients.

The loss that mixes its logits with the task loss is ``losses.DistillationLoss``; ``run.py`` builds
both; a checkpoint records the teacher's identity (``components.TeacherIdentity``), never its logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from yacs.config import CfgNode

from distribuuuu.checkpointing.checkpoint import load_checkpoint, model_state_from, named_by, weights_digest
from distribuuuu.config import ConfigError
from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger
from distribuuuu.models import load_model_weights, model_num_classes, model_source, weights_fit
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.stored_config import SHAPE_KEYS, cfg_from_checkpoint

logger = get_logger("distillation")


class Teacher:
    """A frozen teacher: eval mode, no gradients; call it inside the student's autocast.

    Not an ``nn.Module`` attribute of anything the trainer puts in train mode, wraps in DDP or
    checkpoints: its BatchNorm keeps its running statistics and its weights never change.
    """

    def __init__(self, module: nn.Module, identity: dict):
        self.module, self.identity = module, identity

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = self.module(images)
        # Sharded (DISTILL.SHARD_TEACHER): no backward follows to free the gathered weights, so free them here.
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return logits

    def digest(self) -> str:
        """SHA-256 of the weights it holds now (replicated teacher): the identity's ``sha256`` unless they changed."""
        return weights_digest(self.module.state_dict())


def load_teacher(cfg: CfgNode, classes: Sequence[str], device: torch.device) -> Teacher:
    """Build DISTILL.TEACHER's model (architecture and shape keys from its checkpoint, or DISTILL.ARCH),
    load its DISTILL.WEIGHTS_KIND weights, freeze it; a bad path, weights that do not fit, or other
    classes than the student's are a ConfigError naming the key."""
    d = cfg.DISTILL
    state = read_teacher_checkpoint(d.TEACHER)
    model_cfg = teacher_model_cfg(state, d, cfg.MODEL.NUM_CLASSES)
    if d.WEIGHTS_KIND == "ema" and not state.get("ema"):
        raise ConfigError(
            f"DISTILL.WEIGHTS_KIND ema: {d.TEACHER} holds no EMA weights (set DISTILL.WEIGHTS_KIND model)"
        )
    weights = model_state_from(state, d.WEIGHTS_KIND)
    # Building a model draws its initial weights from the global RNG: forked, so that the student's
    # augmentation and mixup draw what they draw without a teacher (DISTILL.ALPHA 0 is bit-identical).
    with torch.random.fork_rng(devices=[]):
        model = build_configured_model(model_cfg)
    own = model.state_dict()
    fit = weights_fit(own, weights)
    if fit.missing or fit.unexpected or fit.other_shape:  # all or nothing: a teacher is never fine-tuned
        raise ConfigError(
            f"DISTILL.TEACHER: {d.TEACHER} does not fit {model_cfg.ARCH} (it fills {len(fit.filled)} of its "
            f"{len(own)} tensors: {fit.shortfall()}): set DISTILL.ARCH to the teacher's architecture"
        )
    try:
        load_model_weights(model, weights)
    except RuntimeError as e:
        raise ConfigError(
            f"DISTILL.TEACHER: {d.TEACHER} does not fit {model_cfg.ARCH} ({first_line(e)[:200]}): set DISTILL.ARCH "
            "to the teacher's architecture"
        ) from None
    check_teacher_classes(state, model, classes, cfg.MODEL.NUM_CLASSES, d.TEACHER)
    model = model.to(device)
    if cfg.TRAIN.CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    model.eval().requires_grad_(False)
    identity = {"path": d.TEACHER, "sha256": weights_digest(weights), "arch": model_cfg.ARCH, "kind": d.WEIGHTS_KIND}
    logger.info(
        "DISTILL.TEACHER %s: %s (%s weights, sha256 %s), alpha %g, %s",
        d.TEACHER, model_cfg.ARCH, d.WEIGHTS_KIND, identity["sha256"][:12], d.ALPHA,
        "hard labels (argmax)" if d.HARD else f"soft labels at temperature {d.TEMPERATURE:g}",
    )  # fmt: skip
    return Teacher(model, identity)


def read_teacher_checkpoint(path: str) -> dict:
    """The teacher's checkpoint (a file or a ``.dcp`` folder), or a ConfigError naming DISTILL.TEACHER."""
    if not os.path.exists(path):
        raise ConfigError(f"DISTILL.TEACHER: no checkpoint file or .dcp folder at {path}")
    with named_by("DISTILL.TEACHER"):
        return load_checkpoint(path)


def teacher_model_cfg(state: dict, distill_cfg: CfgNode, num_classes: int) -> CfgNode:
    """The teacher's MODEL section: its checkpoint's architecture, classes and MODEL.KWARGS, DISTILL.ARCH first.

    Weights without a stored config (a bare state_dict) take DISTILL.ARCH and the student's class count.
    """
    model_cfg = cfg_from_checkpoint(state, None, [], SHAPE_KEYS, source=distill_cfg.TEACHER).MODEL
    model_cfg.defrost()
    if not (state.get("cfg") or state.get("classes")):
        model_cfg.NUM_CLASSES = num_classes
    if distill_cfg.ARCH:
        model_cfg.ARCH = distill_cfg.ARCH
    elif not (state.get("arch") or state.get("cfg")):
        raise ConfigError(f"DISTILL.ARCH: {distill_cfg.TEACHER} names no architecture: set DISTILL.ARCH")
    try:
        model_source(model_cfg.ARCH)
    except ConfigError as e:  # its line names MODEL.ARCH: the student's key, not the teacher's
        raise ConfigError(str(e).replace("MODEL.ARCH", "DISTILL.ARCH", 1)) from None
    model_cfg.PRETRAINED, model_cfg.PRETRAINED_WEIGHTS = False, ""
    return model_cfg


def check_teacher_classes(state: dict, model: nn.Module, classes: Sequence[str], num_classes: int, path: str) -> None:
    """Raise a ConfigError naming DISTILL.TEACHER when the teacher predicts other classes than the student."""
    outputs = model_num_classes(model)
    if outputs != num_classes:
        raise ConfigError(
            f"DISTILL.TEACHER: {path} predicts {outputs} classes, the student (MODEL.NUM_CLASSES) {num_classes}"
        )
    saved = list(state.get("classes") or [])
    if saved and list(classes) and saved != list(classes):
        differ = [f"{i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(saved, classes)) if a != b]
        raise ConfigError(
            f"DISTILL.TEACHER: {path} was trained on other classes than TRAIN.DATASET's ({len(saved)} vs "
            f"{len(classes)}; teacher vs student {differ[:3]})"
        )
