"""Data: datasets, transforms, samplers and loaders, built from explicit arguments (the config is
read by ``training/inputs.py`` and ``training/preprocessing.py``)."""

from distribuuuu.data.classes import map_classes
from distribuuuu.data.encoded import load_image
from distribuuuu.data.errors import BadImageError, DataError, DeviceMemoryError
from distribuuuu.data.loader import DeviceLoader, Split, dataset_targets, label_counts, sample_paths
from distribuuuu.data.samplers import ExactEvalSampler, ResumableDistributedSampler

__all__ = [
    "BadImageError",
    "DataError",
    "DeviceMemoryError",
    "DeviceLoader",
    "ExactEvalSampler",
    "ResumableDistributedSampler",
    "Split",
    "dataset_targets",
    "label_counts",
    "load_image",
    "map_classes",
    "sample_paths",
]
