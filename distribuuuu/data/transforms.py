"""Train/val transforms and batch-level mixup/cutmix, all from torchvision.transforms.v2."""

from __future__ import annotations

from typing import Callable

import torch
from torchvision.transforms import v2
from yacs.config import CfgNode


def build_train_transform(cfg: CfgNode) -> Callable:
    """RandomResizedCrop(TRAIN.IM_SIZE) + flip [+ auto-augment] + normalise [+ random erasing]."""
    d = cfg.DATA
    steps = [
        v2.ToImage(),
        v2.RandomResizedCrop(cfg.TRAIN.IM_SIZE, scale=(d.CROP_SCALE_MIN, 1.0), antialias=True),
    ]
    if d.HFLIP_PROB > 0:
        steps.append(v2.RandomHorizontalFlip(d.HFLIP_PROB))
    policy = {
        "randaugment": lambda: v2.RandAugment(magnitude=d.RANDAUGMENT_MAGNITUDE),
        "trivialaugment": v2.TrivialAugmentWide,
        "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    }.get(d.AUTO_AUGMENT)
    if policy is not None:
        steps.append(policy())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(d.MEAN, d.STD)]
    if d.RANDOM_ERASING > 0:
        steps.append(v2.RandomErasing(p=d.RANDOM_ERASING, value=0))
    return v2.Compose(steps)


def build_val_transform(cfg: CfgNode) -> Callable:
    """Resize(TEST.IM_SIZE) + CenterCrop(TRAIN.IM_SIZE) + normalise."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(cfg.TEST.IM_SIZE, antialias=True),
            v2.CenterCrop(cfg.TRAIN.IM_SIZE),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(cfg.DATA.MEAN, cfg.DATA.STD),
        ]
    )


def build_batch_mixer(cfg: CfgNode) -> Callable | None:
    """Return mixup/cutmix applied to a batch with probability MIX_PROB, or None if disabled.

    The mixer maps (images, int targets) to (images, soft targets that sum to 1).
    """
    d, num_classes = cfg.DATA, cfg.MODEL.NUM_CLASSES
    choices, weights = [], []
    if d.MIXUP_ALPHA > 0:
        choices.append(v2.MixUp(alpha=d.MIXUP_ALPHA, num_classes=num_classes))
        weights.append(1.0 - d.MIX_SWITCH_PROB if d.CUTMIX_ALPHA > 0 else 1.0)
    if d.CUTMIX_ALPHA > 0:
        choices.append(v2.CutMix(alpha=d.CUTMIX_ALPHA, num_classes=num_classes))
        weights.append(d.MIX_SWITCH_PROB if d.MIXUP_ALPHA > 0 else 1.0)
    if not choices:
        return None
    mix = v2.RandomChoice(choices, p=weights)

    def mixer(images: torch.Tensor, targets: torch.Tensor):
        # The coin is drawn on the CPU generator: no device sync, and saved in checkpoints.
        if d.MIX_PROB < 1.0 and torch.rand(()).item() >= d.MIX_PROB:
            return images, torch.nn.functional.one_hot(targets, num_classes).to(images.dtype)
        return mix(images, targets)

    return mixer
