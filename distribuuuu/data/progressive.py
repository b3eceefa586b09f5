"""Progressive resizing (FFCV): the training crop size as a function of the epoch, and a transform per size.

The size is a pure function of (epoch, config), so every rank, every DataLoader worker and every
resumed run, on any world size, computes the same size for the same epoch. The per-sample path
reads the epoch from each sampler key, which is how persistent workers, built once, learn it;
the batched decoder (DATA.DECODER batched) transforms in the training process, which is told the
epoch as each epoch's iteration starts (``EpochTransforms.set_epoch``). With DATA.BATCHED_AUGMENT
the workers draw the crops (resample.TrainGeometry, one per size, picked by the key's epoch) and
the training process resamples each batch to the size its plans carry.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from yacs.config import CfgNode


def progressive_on(train_cfg: CfgNode) -> bool:
    """Whether TRAIN.PROGRESSIVE_START_SIZE turns progressive resizing on."""
    return train_cfg.PROGRESSIVE_START_SIZE > 0


def train_size(epoch: int, train_cfg: CfgNode) -> int:
    """The training crop size of ``epoch`` (numbered from 0): TRAIN.IM_SIZE, or under progressive
    resizing FFCV's ``get_resolution`` (ffcv-imagenet's train_imagenet.py) with start_ramp/end_ramp
    PROGRESSIVE_START_EPOCH/END_EPOCH, min_res PROGRESSIVE_START_SIZE and max_res TRAIN.IM_SIZE."""
    t = train_cfg
    if not progressive_on(t):
        return t.IM_SIZE
    if epoch <= t.PROGRESSIVE_START_EPOCH:
        return t.PROGRESSIVE_START_SIZE
    if epoch >= t.PROGRESSIVE_END_EPOCH:
        return t.IM_SIZE
    ramp = [t.PROGRESSIVE_START_EPOCH, t.PROGRESSIVE_END_EPOCH], [t.PROGRESSIVE_START_SIZE, t.IM_SIZE]
    size = np.interp([epoch], *ramp)[0]
    # np.round as FFCV: halves to the even multiple
    return int(np.round(size / t.PROGRESSIVE_SIZE_MULTIPLE)) * t.PROGRESSIVE_SIZE_MULTIPLE


def schedule_sizes(cfg: CfgNode) -> list[int]:
    """The distinct training sizes of the run's epochs, in the order they come."""
    return list(dict.fromkeys(train_size(epoch, cfg.TRAIN) for epoch in range(cfg.OPTIM.MAX_EPOCH)))


def schedule_text(cfg: CfgNode) -> str:
    """The run's sizes by epoch as the log counts them (from 1): '8 px: epoch 1; 12 px: epochs 2-3; ...'."""
    spans: list[list[int]] = []  # [size, first epoch, last epoch]
    for epoch in range(cfg.OPTIM.MAX_EPOCH):
        size = train_size(epoch, cfg.TRAIN)
        if spans and spans[-1][0] == size:
            spans[-1][2] = epoch + 1
        else:
            spans.append([size, epoch + 1, epoch + 1])
    return "; ".join(f"{s} px: epoch{'s' if a < b else ''} {a}{f'-{b}' if a < b else ''}" for s, a, b in spans)


def for_key_epoch(transform, round_: int, rounds_per_epoch: int):
    """``transform``, or where it has ``for_epoch`` (EpochTransforms) the one of the epoch of a key
    whose first element is ``round_``: an augmentation round, ``rounds_per_epoch`` of them an epoch
    (1 but for the repeated and weighted samplers)."""
    return transform.for_epoch(round_ // rounds_per_epoch) if hasattr(transform, "for_epoch") else transform


class EpochTransforms:
    """The training transform of each epoch: ``build(size)`` made once for each size of the schedule.

    ``for_epoch(e)`` is epoch e's transform (SeededTransformDataset and EncodedImageDataset ask it
    with each key's epoch; the latter's "transforms" are the batched resample's geometries);
    calling the object applies the transform of the epoch last given to ``set_epoch`` (the batched
    decoder's transform, called in the training process, where the loader sets the epoch).
    """

    def __init__(self, cfg: CfgNode, build: Callable[[int], Callable]):
        self.train_cfg = cfg.TRAIN
        self.transforms = {size: build(size) for size in schedule_sizes(cfg)}
        self.epoch = 0

    def for_epoch(self, epoch: int) -> Callable:
        return self.transforms[train_size(epoch, self.train_cfg)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, image):
        return self.for_epoch(self.epoch)(image)
