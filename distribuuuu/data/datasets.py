"""Datasets: the ImageFolder reader (over an index in arrays), multi-hot targets, synthetic data,
per-sample seeded transforms and the collate that drops unreadable images. Which reader reads a
root is readers.py's registry."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, TypeVar

import numpy as np
import torch
import torchvision
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from distribuuuu.data.encoded import load_image, read_image_file
from distribuuuu.data.errors import BadImageError, DataError
from distribuuuu.data.folder_index import FolderIndex, scan_folder
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS
from distribuuuu.data.index import Samples
from distribuuuu.data.progressive import for_key_epoch

T = TypeVar("T")


class CheckedImageFolder(torchvision.datasets.ImageFolder):
    """ImageFolder over an index listed once into arrays (data/folder_index.py: the samples ImageFolder
    lists, a few bytes each), that names the file that fails to decode and decodes as DATA.DECODER says."""

    def __init__(
        self,
        root: str,
        decoder: str = "auto",
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        index: FolderIndex | None = None,
    ):
        # Not ImageFolder.__init__, which lists the folder into a list of tuples: the index replaces it.
        torchvision.datasets.VisionDataset.__init__(self, root)
        index = index if index is not None else scan_folder(self.root)
        self.loader = functools.partial(load_image, decoder=decoder, max_pixels=max_pixels)
        self.extensions = IMG_EXTENSIONS
        self.classes = list(index.classes)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = self.imgs = Samples(index.paths, index.labels, self.root)
        self.targets = self.samples.labels

    def encoded(self, index: int) -> tuple[bytes, str, int]:
        """Sample ``index``'s file bytes, its path, its target (the batched decoder's input)."""
        path, target = self.samples[index]
        return read_image_file(path), path, target


def check_classes(root: str, dataset: CheckedImageFolder) -> None:
    """Raise DataError for class folders with no images."""
    counts = np.bincount(np.asarray(dataset.targets, dtype=np.int64), minlength=len(dataset.classes))
    empty = [c for c, n in zip(dataset.classes, counts) if n == 0]
    if not dataset.classes:
        raise DataError(f"{root}: no class folders found (expected {root}/<class>/<image>)")
    if empty:
        raise DataError(f"{root}: class folder(s) with no images ({', '.join(IMG_EXTENSIONS)}): {empty}")


def here(decide: Callable[[], T]) -> T:
    """Run ``decide`` in this process: how a lone process (a tool, a test) lists a split."""
    return decide()


class MultiHotTargets(Dataset):
    """A dataset whose targets (class indices, or one index) become multi-hot float vectors of
    ``num_classes`` (MODEL.TASK multilabel); its other attributes (``samples``, ``classes``, ...) are
    the wrapped dataset's."""

    def __init__(self, base: Dataset, num_classes: int):
        self.base, self.num_classes = base, num_classes

    def __len__(self) -> int:
        return len(self.base)

    def multi_hot(self, target) -> torch.Tensor:
        hot = torch.zeros(self.num_classes)
        hot[list(target) if isinstance(target, tuple) else target] = 1.0
        return hot

    def __getitem__(self, index: int):
        image, target = self.base[index]
        return image, self.multi_hot(target)

    def encoded(self, index: int):
        """The wrapped dataset's encoded sample, its target multi-hot (the batched decoder's input)."""
        data, name, target = self.base.encoded(index)
        return data, name, self.multi_hot(target)

    def __getattr__(self, name: str):
        if name == "base":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.base, name)


class SyntheticDataset(Dataset):
    """In-memory random uint8 images and labels, for speed tests.

    uint8, as decoded pixels are: the loader copies them to the device and normalises them there,
    as it does real batches. Normalised float32 images were 4x the bytes through the workers, the
    pinning and the copy to the device on the training stream: on an H200, compiled ResNet-50 at
    batch 256 trained slower on them (3,769 img/s) than from JPEGs (4,402; docs/gpu.md)."""

    def __init__(self, size: int, im_size: int, num_classes: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (size, 3, im_size, im_size), generator=g, dtype=torch.uint8)
        self.targets = torch.randint(0, num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.images[index], int(self.targets[index])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed of one sample's augmentation in one epoch."""
    return (seed * 1_000_003 + epoch) * 10_000_019 + index


@contextlib.contextmanager
def seeded_cpu_rng(seed: int):
    """Run a block with the global CPU generator seeded to ``seed``, then restore its state.

    torchvision's transforms draw their random parameters from this generator, whatever device
    the image is on. Only the CPU generator is seeded (torch.manual_seed would also reseed CUDA's,
    which dropout draws from, when transforms run in the training process).
    """
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield


class SeededTransformDataset(Dataset):
    """Apply ``transform`` with an RNG seeded from (seed, epoch, index) for each sample.

    Keys are ``(epoch, index)`` pairs from ResumableDistributedSampler. Seeding per sample makes
    the augmentation of a sample independent of the number of workers, the world size and where
    a resumed epoch starts, so a mid-epoch resume reproduces an uninterrupted run exactly.
    ``fork_rng`` restores the global CPU RNG afterwards, so the main process's stream (dropout,
    mixup) is untouched when there are no workers. With ``skip_bad``, an undecodable image
    yields ``None`` and the collate function drops and counts it.

    A transform with ``for_epoch`` (progressive resizing's EpochTransforms) is asked for the key's
    epoch's own: the key's first element is an augmentation round, ``rounds_per_epoch`` of them an
    epoch (1 but for the repeated and weighted samplers, whose value the loader sets here).
    """

    rounds_per_epoch = 1

    def __init__(self, base: Dataset, transform: Callable | None, seed: int, skip_bad: bool = False):
        self.base, self.transform, self.seed, self.skip_bad = base, transform, seed, skip_bad

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        try:
            image, target = self.base[index]
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        if self.transform is None:
            return image, target
        transform = for_key_epoch(self.transform, epoch, self.rounds_per_epoch)
        with seeded_cpu_rng(sample_seed(self.seed, epoch, index)):
            return transform(image), target


def readable(batch: list) -> list:
    """The samples of a batch that are not ``None`` (unreadable, skipped); an error if none is."""
    kept = [b for b in batch if b is not None]
    if not kept:
        raise BadImageError(f"every image of a batch of {len(batch)} was unreadable")
    return kept


def collate_skipping_bad(batch: list):
    """Collate like the default, dropping ``None`` samples; returns (images, targets, n_dropped)."""
    kept = readable(batch)
    images, targets = torch.utils.data.default_collate(kept)
    return images, targets, len(batch) - len(kept)
