"""The tiny run and the tensor walk of the GPU-and-cluster-paths tests, in unit and integration alike."""

from __future__ import annotations

import torch
from helpers import REPO

DIGITS = str(REPO / "data" / "digits")


TINY = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.DATASET", DIGITS,
    "TEST.DATASET", DIGITS, "OPTIM.MAX_EPOCH", "1",
]  # fmt: skip


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
