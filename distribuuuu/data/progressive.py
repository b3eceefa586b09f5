"""Progressive resizing (FFCV): the training crop size as a function of the epoch, and a transform per size.

The size is a pure function of (epoch, ``Progressive``), so every rank, every DataLoader worker and every
resumed run, on any world size, computes the same size for the same epoch. The per-sample path
reads the epoch from each sampler key, which is how persistent workers, built once, learn it;
the batched decoder (DATA.DECODER batched) transforms in the training process, which is told the
epoch as each epoch's iteration starts (``EpochTransforms.set_epoch``). With DATA.BATCHED_AUGMENT
the workers draw the crops (resample.TrainGeometry, one per size, picked by the key's epoch) and
the training process resamples each batch to the size its plans carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Progressive:
    """The training crop size of each epoch: ``size`` throughout, or, from ``start_size`` > 0, FFCV's
    ramp from ``start_size`` (to ``start_epoch``) to ``size`` (from ``end_epoch``) in steps of ``multiple``,
    over a run of ``max_epoch`` epochs (TRAIN.IM_SIZE, TRAIN.PROGRESSIVE_*, OPTIM.MAX_EPOCH)."""

    size: int
    start_size: int = 0
    start_epoch: int = 0
    end_epoch: int = 0
    multiple: int = 32
    max_epoch: int = 1

    @property
    def on(self) -> bool:
        """Whether a start size turns progressive resizing on."""
        return self.start_size > 0

    def size_at(self, epoch: int) -> int:
        """The training crop size of ``epoch`` (numbered from 0): FFCV's ``get_resolution``
        (ffcv-imagenet's train_imagenet.py) with start_ramp/end_ramp ``start_epoch``/``end_epoch``,
        min_res ``start_size`` and max_res ``size``."""
        if not self.on:
            return self.size
        if epoch <= self.start_epoch:
            return self.start_size
        if epoch >= self.end_epoch:
            return self.size
        ramp = [self.start_epoch, self.end_epoch], [self.start_size, self.size]
        size = np.interp([epoch], *ramp)[0]
        return int(np.round(size / self.multiple)) * self.multiple  # np.round as FFCV: halves to the even multiple

    def sizes(self) -> list[int]:
        """The distinct training sizes of the run's epochs, in the order they come."""
        return list(dict.fromkeys(self.size_at(epoch) for epoch in range(self.max_epoch)))

    def text(self) -> str:
        """The run's sizes by epoch as the log counts them (from 1): '8 px: epoch 1; 12 px: epochs 2-3; ...'."""
        spans: list[list[int]] = []  # [size, first epoch, last epoch]
        for epoch in range(self.max_epoch):
            size = self.size_at(epoch)
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

    def __init__(self, schedule: Progressive, build: Callable[[int], Callable]):
        self.schedule = schedule
        self.transforms = {size: build(size) for size in schedule.sizes()}
        self.epoch = 0

    def for_epoch(self, epoch: int) -> Callable:
        return self.transforms[self.schedule.size_at(epoch)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, image):
        return self.for_epoch(self.epoch)(image)
