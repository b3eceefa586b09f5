"""DataLoaders whose batches arrive on the device, built from explicit arguments (the config is read
by ``training/inputs.py``): the per-sample and batched-decode datasets, the loader, and what a
split holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from distribuuuu.data.batched import BatchDecoder, EncodedImageDataset, collate_encoded
from distribuuuu.data.datasets import SeededTransformDataset, collate_skipping_bad
from distribuuuu.data.prefetch import prefetched
from distribuuuu.data.progressive import EpochTransforms
from distribuuuu.data.resample import EvalGeometry, TrainGeometry
from distribuuuu.data.transforms import Normalize
from distribuuuu.runtime.preemption import ignore_preemption_signals


@dataclass
class Split:
    """A split's loader with its dataset, sampler and class names."""

    loader: DeviceLoader
    dataset: Dataset
    sampler: torch.utils.data.Sampler
    classes: list[str]


class DeviceLoader:
    """A DataLoader whose batches arrive on the training device as ``(images, targets, dropped)``
    with normalised float images: uint8 pixels (MODEL.DUMMY_INPUT's too) are copied
    (asynchronously from pinned memory) and normalised there; DATA.DECODER batched decodes and
    augments each batch there first, on a thread one batch ahead (prefetch.py), with or without
    workers: the loader is read in this thread, so without workers the dataset's seeded draws stay
    here, and the thread only decodes and resamples. Float batches (already normalised by the
    batched resample) pass as they are. ``len``, ``sampler``, ``batch_size`` ... are the wrapped loader's. timm's PrefetchLoader
    idea without its side stream: the non-blocking copy frees the host at once but queues behind
    the step's kernels on the default stream; a uint8
    batch is a quarter of float32's bytes, small against a training step. ``epoch_transforms``:
    the batched decoder's transform under progressive resizing, told the sampler's epoch as each
    epoch's iteration starts (the decoder transforms here, in this process)."""

    def __init__(
        self, loader: DataLoader, device: torch.device, normalize, decode: BatchDecoder | None = None,
        epoch_transforms: EpochTransforms | None = None,
    ):  # fmt: skip
        self.loader, self.device, self.normalize, self.decode = loader, device, normalize, decode
        self.epoch_transforms = epoch_transforms

    def __iter__(self):
        if self.epoch_transforms is not None:
            self.epoch_transforms.set_epoch(self.loader.sampler.epoch)
        for batch in self._batches():
            images, targets, dropped = batch if self.decode is None else self.decode.finish(batch)
            images = images.to(self.device, non_blocking=True)
            yield self.normalize(images) if images.dtype == torch.uint8 else images, targets, dropped

    def _batches(self):
        if self.decode is None:
            return iter(self.loader)
        return prefetched(self.loader, self.decode.prepare, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)


@dataclass(frozen=True)
class LoaderOptions:
    """How a split's DataLoader reads: TRAIN.WORKERS worker processes (kept between epochs with
    ``persistent``), each ``prefetch_factor`` batches ahead, into pinned memory on CUDA; ``seed``
    seeds its own generator."""

    workers: int = 0
    pin_memory: bool = True
    persistent: bool = False
    prefetch_factor: int = 2
    seed: int = 0


def make_loader(
    dataset: Dataset,
    sampler,
    batch_size: int,
    device: torch.device,
    normalize: Normalize,
    options: LoaderOptions,
    train: bool,
    decoder: BatchDecoder | None = None,
    epoch_transforms: EpochTransforms | None = None,
) -> DeviceLoader:
    """The DeviceLoader of ``dataset`` sampled by ``sampler``: whole batches only in training
    (BatchNorm), every sample in evaluation."""
    workers = options.workers
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=options.pin_memory and device.type == "cuda",
        drop_last=train,  # no tiny last batch in training (BatchNorm); eval sees every sample
        persistent_workers=workers > 0 and options.persistent,
        prefetch_factor=options.prefetch_factor if workers > 0 else None,
        collate_fn=collate_skipping_bad if decoder is None else collate_encoded,
        worker_init_fn=ignore_preemption_signals,  # the trainer handles them: see runtime/faults.py
        # Its own generator, so creating an epoch's iterator does not draw from the global RNG:
        # otherwise a resumed run's random stream would drift from the uninterrupted run's.
        generator=torch.Generator().manual_seed(options.seed),
    )
    return DeviceLoader(loader, device, normalize, decoder, epoch_transforms)


def fixed_batch_loader(
    dataset: Dataset, batch_sampler, device: torch.device, normalize: Normalize, options: LoaderOptions, decoder=None
) -> DeviceLoader:
    """A DeviceLoader of fixed batches (precise BN's): no persistent workers, read once per evaluation."""
    loader = DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=options.workers,
        pin_memory=options.pin_memory and device.type == "cuda",
        collate_fn=collate_skipping_bad if decoder is None else collate_encoded,
        worker_init_fn=ignore_preemption_signals,
    )  # no persistent workers: read once per evaluation, they would hold memory between
    return DeviceLoader(loader, device, normalize, decoder)


def takes_batched_decode(base: Dataset) -> bool:
    """Whether DATA.DECODER batched can read ``base``'s samples as encoded bytes: its reader says so
    (readers.py: folders, annotation files, packed shards, saved Hugging Face datasets; not CIFAR's
    arrays or synthetic data, which no reader read)."""
    reader = getattr(base, "read_by", None)  # MultiHotTargets passes its base's attributes through
    return reader is not None and reader.batched


@dataclass(frozen=True)
class BatchedDecode:
    """DATA.DECODER batched: what the training process does to each batch (``transform``: per-sample
    steps after the batched resample; ``geometry``: the batched resample) and what the workers draw
    (``worker_geometry``: the crops, by epoch under progressive resizing)."""

    transform: object = None
    geometry: TrainGeometry | EvalGeometry | None = None
    worker_geometry: object = None


def sampled_dataset(
    base: Dataset,
    transform,
    seed: int,
    skip_bad: bool,
    device: torch.device,
    normalize: Normalize,
    batched: BatchedDecode | None = None,
    channels_last: bool = False,
    max_pixels: int = 0,
    memory_budget: int = 0,
) -> tuple[Dataset, BatchDecoder | None]:
    """The dataset the sampler's keys index, and the training-process decoder when JPEGs are decoded
    by the batch (``batched``); otherwise ``transform`` runs per sample, seeded by the key. The batched
    decode's workers refuse a JPEG whose header declares more than ``max_pixels`` (0: no limit); its
    resample takes at most ``memory_budget`` bytes of device memory at once (0: no limit)."""
    if batched is None:
        return SeededTransformDataset(base, transform, seed, skip_bad), None
    decoder = BatchDecoder(
        batched.transform, device, skip_bad, geometry=batched.geometry, normalize=normalize,
        channels_last=channels_last, max_pixels=max_pixels, memory_budget=memory_budget,
    )  # fmt: skip
    return EncodedImageDataset(base, seed, skip_bad, batched.worker_geometry, max_pixels), decoder


def precise_bn_indices(dataset_len: int, images: int, seed: int) -> list[int]:
    """The training samples precise BN reads: the first ``images`` of a permutation seeded by RNG_SEED
    (an ImageFolder lists its samples class by class, so its first N would be one class)."""
    return torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed))[:images].tolist()


def dataset_targets(dataset: Dataset) -> torch.Tensor:
    """Every sample's class index, read from the dataset's labels (no image is decoded)."""
    base = getattr(dataset, "base", dataset)  # SeededTransformDataset / EncodedImageDataset wrap it
    return torch.as_tensor(np.asarray(base.targets), dtype=torch.int64)  # a reader's Labels: one array


def label_counts(dataset: Dataset, num_classes: int) -> torch.Tensor:
    """How many samples each class labels (a multi-label sample counts for each of its classes)."""
    counts = torch.zeros(num_classes, dtype=torch.int64)
    for target in getattr(dataset, "base", dataset).targets:
        counts[list(target) if isinstance(target, tuple) else target] += 1
    return counts


def sample_paths(dataset: Dataset) -> list[str]:
    """Each sample's file path (ImageFolder), or an empty list (CIFAR, synthetic data)."""
    base = getattr(dataset, "base", dataset)
    return [path for path, _ in getattr(base, "samples", [])]
