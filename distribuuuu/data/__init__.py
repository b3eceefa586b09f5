"""Data: datasets, transforms, samplers and loaders."""

from distribuuuu.data.classes import map_classes
from distribuuuu.data.encoded import load_image
from distribuuuu.data.errors import BadImageError, DataError
from distribuuuu.data.loader import (
    Split,
    build_extra_val_splits,
    build_precise_bn_split,
    build_train_split,
    build_val_split,
    dataset_targets,
    label_counts,
    sample_paths,
)
from distribuuuu.data.samplers import ExactEvalSampler, ResumableDistributedSampler
from distribuuuu.data.transforms import build_batch_mixer, build_train_transform, build_val_transform

__all__ = [
    "BadImageError",
    "DataError",
    "ExactEvalSampler",
    "ResumableDistributedSampler",
    "Split",
    "build_batch_mixer",
    "build_extra_val_splits",
    "build_precise_bn_split",
    "build_train_split",
    "build_train_transform",
    "build_val_split",
    "build_val_transform",
    "dataset_targets",
    "label_counts",
    "map_classes",
    "load_image",
    "sample_paths",
]
