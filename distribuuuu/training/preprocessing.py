"""What the config asks of the images, translated into the data layer's arguments: the training
augmentation (``TrainAugment``), the progressive schedule, evaluation's preprocessing (resolved with a
pretrained timm model's own values; a checkpoint's stored one), normalisation and the batch mixer."""

from __future__ import annotations

from typing import Callable

from yacs.config import CfgNode

from distribuuuu.config import get_cfg_defaults, stored_config
from distribuuuu.data.progressive import EpochTransforms, Progressive
from distribuuuu.data.transforms import (
    EvalPreprocessing,
    MixOptions,
    Normalize,
    TrainAugment,
    batch_mixer,
    build_eval_transform,
    resolve_eval_preprocessing,
    train_transform,
)
from distribuuuu.models import timm_pretrained_cfg
from distribuuuu.training.task import build_task


def eval_crop_size(cfg: CfgNode) -> int:
    """The evaluation center-crop size: TEST.CROP_SIZE, or TRAIN.IM_SIZE when it is 0."""
    return cfg.TEST.CROP_SIZE or cfg.TRAIN.IM_SIZE


def progressive(cfg: CfgNode) -> Progressive:
    """The training crop size of each epoch: TRAIN.IM_SIZE, or TRAIN.PROGRESSIVE_*'s ramp to it."""
    t = cfg.TRAIN
    return Progressive(
        t.IM_SIZE, t.PROGRESSIVE_START_SIZE, t.PROGRESSIVE_START_EPOCH, t.PROGRESSIVE_END_EPOCH,
        t.PROGRESSIVE_SIZE_MULTIPLE, cfg.OPTIM.MAX_EPOCH,
    )  # fmt: skip


def train_augment(cfg: CfgNode, size: int | None = None) -> TrainAugment:
    """DATA.*'s training augmentation, cropping to ``size`` (default TRAIN.IM_SIZE)."""
    d = cfg.DATA
    fill = tuple(round(255 * m) for m in eval_preprocessing(cfg).mean)  # the normalisation's mean: ~0 once normalised
    return TrainAugment(
        size or cfg.TRAIN.IM_SIZE, d.CROP_SCALE_MIN, d.HFLIP_PROB, d.AUTO_AUGMENT, d.RANDAUGMENT_MAGNITUDE,
        d.RANDOM_ERASING, fill, draft=d.DECODER == "draft", color_jitter=d.COLOR_JITTER,
    )  # fmt: skip


def build_train_transform(cfg: CfgNode, normalize: bool = True, size: int | None = None) -> Callable:
    """The per-sample training transform to ``size`` (default TRAIN.IM_SIZE) [+ normalisation]."""
    return train_transform(train_augment(cfg, size), build_normalize(cfg) if normalize else None)


def epoch_train_transform(cfg: CfgNode) -> Callable:
    """The training transform (uint8 out); under progressive resizing one per size, picked by the epoch."""
    schedule = progressive(cfg)
    if schedule.on:
        return EpochTransforms(schedule, lambda size: build_train_transform(cfg, normalize=False, size=size))
    return build_train_transform(cfg, normalize=False)


def eval_preprocessing(cfg: CfgNode) -> EvalPreprocessing:
    """Resolve the evaluation keys: TEST.CROP_SIZE (0: TRAIN.IM_SIZE), TEST.IM_SIZE or the crop /
    TEST.CROP_PCT, TEST.INTERPOLATION, DATA.MEAN / STD. A pretrained timm model's own values
    (``timm.data.resolve_data_config``) fill in the keys left at their defaults: CROP_PCT 0,
    INTERPOLATION "", MEAN / STD at the ImageNet defaults."""
    t, d, defaults = cfg.TEST, cfg.DATA, get_cfg_defaults().DATA
    model_defaults = {} if cfg.MODEL.DUMMY_INPUT else _timm_data_config(cfg.MODEL)
    explicit = list(d.MEAN) != list(defaults.MEAN) or list(d.STD) != list(defaults.STD)
    keep = explicit or not model_defaults
    return resolve_eval_preprocessing(
        eval_crop_size(cfg), t.IM_SIZE, t.CROP_PCT, t.INTERPOLATION, tuple(d.MEAN) if keep else None,
        tuple(d.STD) if keep else None, model_defaults,
    )  # fmt: skip


def _timm_data_config(model_cfg: CfgNode) -> dict:
    """A pretrained timm model's own preprocessing; {} for any other model."""
    weights = model_cfg.PRETRAINED_WEIGHTS or ("DEFAULT" if model_cfg.PRETRAINED else None)
    return timm_pretrained_cfg(model_cfg.ARCH, weights) or {}


def checkpoint_preprocessing(state: dict) -> EvalPreprocessing:
    """The preprocessing a checkpoint's run validated with: stored beside its weights, or, in a
    checkpoint written before it was stored, resolved from its config as validation resolved it."""
    if state.get("preprocessing"):
        return EvalPreprocessing.from_dict(state["preprocessing"])
    cfg = get_cfg_defaults()
    saved = stored_config(state["cfg"], "the checkpoint") if state.get("cfg") else CfgNode()
    for section in ("MODEL", "TRAIN", "TEST", "DATA"):  # key by key: an older config may lack some
        for key, value in saved.get(section, {}).items():
            if key in cfg[section] and not isinstance(value, dict):
                cfg[section][key] = value
    return eval_preprocessing(cfg)


def build_normalize(cfg: CfgNode) -> Normalize:
    """uint8 pixels (one image or a batch) to float32 normalised by DATA.MEAN / STD (or a pretrained
    timm model's own); the same arithmetic either way, so predict.py's one image and evaluation's
    batch see the same numbers."""
    p = eval_preprocessing(cfg)
    return Normalize(p.mean, p.std)


def build_val_transform(cfg: CfgNode, normalize: bool = True) -> Callable:
    """Resize (shorter side) + CenterCrop [+ normalise], as ``eval_preprocessing`` resolves them."""
    return build_eval_transform(eval_preprocessing(cfg), cfg.DATA.DECODER, normalize)


def build_batch_mixer(cfg: CfgNode) -> Callable | None:
    """DATA.MIXUP_ALPHA / CUTMIX_ALPHA's batch mixer (None when both are 0), of the task's targets."""
    d, multilabel = cfg.DATA, build_task(cfg.MODEL, cfg.TEST).multilabel
    options = MixOptions(
        d.MIXUP_ALPHA, d.CUTMIX_ALPHA, d.MIX_PROB, d.MIX_SWITCH_PROB, cfg.MODEL.NUM_CLASSES, multilabel,
        cfg.TRAIN.BATCH_SIZE,
    )  # fmt: skip
    return batch_mixer(options)
