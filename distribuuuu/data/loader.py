"""Train and val DataLoaders from the config, with the checks that must run before training."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset
from yacs.config import CfgNode

from distribuuuu.config import ConfigError, global_batch
from distribuuuu.data import remote
from distribuuuu.data.annotations import AnnotatedImages, AnnotationSpec
from distribuuuu.data.batched import BatchDecoder, EncodedImageDataset, collate_encoded
from distribuuuu.data.classes import map_classes, remap_targets
from distribuuuu.data.datasets import (
    CheckedImageFolder,
    MultiHotTargets,
    SeededTransformDataset,
    SyntheticDataset,
    build_base_dataset,
    collate_skipping_bad,
)
from distribuuuu.data.encoded import EncodedSamples
from distribuuuu.data.prefetch import prefetched
from distribuuuu.data.progressive import EpochTransforms, progressive_on
from distribuuuu.data.samplers import (
    ExactEvalSampler,
    FixedBatchSampler,
    RepeatedAugmentationSampler,
    ResumableDistributedSampler,
    ShardWindowSampler,
    WeightedDistributedSampler,
    inverse_frequency_weights,
)
from distribuuuu.data.shard_cache import ProgressReporter, ShardCache, ShardCacheError, ShardOrder
from distribuuuu.data.transforms import (
    batched_eval_geometry,
    batched_train_geometry,
    batched_train_steps,
    build_normalize,
    build_train_transform,
    build_val_transform,
)
from distribuuuu.logger import SAME_ON_EVERY_RANK, get_logger
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.preemption import ignore_preemption_signals

logger = get_logger("data")


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
    augments each batch there first, on a thread one batch ahead when there are workers
    (prefetch.py: with none, the dataset's seeded draws run in this process and must not race the
    training thread's). Float batches (already normalised by the batched resample) pass as they
    are. ``len``, ``sampler``, ``batch_size`` ... are the wrapped loader's. timm's PrefetchLoader
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
        if self.loader.num_workers > 0:
            return prefetched(self.loader, self.decode.prepare, self.device)
        return map(self.decode.prepare, self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name == "loader":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)


def annotation_spec(cfg: CfgNode, train: bool) -> AnnotationSpec | None:
    """How to read TRAIN.ANN_FILE (``train``) or TEST.ANN_FILE; None when the split is a folder."""
    ann_file = cfg.TRAIN.ANN_FILE if train else cfg.TEST.ANN_FILE
    if not ann_file:
        return None
    classes_file = (
        os.path.abspath(os.path.join(cfg.TRAIN.DATASET, cfg.DATA.ANN_CLASSES)) if cfg.DATA.ANN_CLASSES else ""
    )
    label_sep = cfg.DATA.ANN_LABEL_SEP if cfg.MODEL.TASK == "multilabel" else ""
    return AnnotationSpec(ann_file, cfg.DATA.ANN_HEADER, classes_file, label_sep)


def _base(cfg: CfgNode, root: str, split: str, train: bool, matched: bool = False) -> tuple[Dataset, list[str]]:
    """The split's dataset and classes. Its classes must fit MODEL.NUM_CLASSES unless ``matched``:
    a val split matched to the model's classes by name, where map_classes names any difference."""
    if cfg.MODEL.DUMMY_INPUT:
        size, classes = cfg.DATA.DUMMY_SIZE, [str(i) for i in range(cfg.MODEL.NUM_CLASSES)]
        seed = cfg.RNG_SEED + (0 if train else 1)
        return SyntheticDataset(size, cfg.TRAIN.IM_SIZE, cfg.MODEL.NUM_CLASSES, seed), classes
    spec = annotation_spec(cfg, train)
    base, classes = build_base_dataset(
        root, split, cfg.DATA.DECODER, cfg.DATA.SHARD_CACHE, spec, cfg.DATA.MAX_IMAGE_PIXELS
    )
    if len(classes) > cfg.MODEL.NUM_CLASSES and not matched:
        raise ConfigError(
            f"MODEL.NUM_CLASSES is {cfg.MODEL.NUM_CLASSES} but {_location(cfg, root, split, train)} has "
            f"{len(classes)} {'classes' if spec else 'class folders'}"
        )
    return base, classes


def _location(cfg: CfgNode, root: str, split: str, train: bool) -> str:
    """What the messages call a split: its annotation file, or its folder."""
    spec = annotation_spec(cfg, train)
    return os.path.join(root, spec.file) if spec else f"{root}/{split}"


def _warn_if_head_too_large(cfg: CfgNode, classes: list[str]) -> None:
    """More outputs than training classes is allowed (a head kept for later classes), rarely meant."""
    if len(classes) < cfg.MODEL.NUM_CLASSES:
        logger.warning(
            "MODEL.NUM_CLASSES is %d but %s has %d classes: %d outputs never train, and predict.py and export.py "
            "refuse the checkpoint; set MODEL.NUM_CLASSES %d unless that head is wanted",
            cfg.MODEL.NUM_CLASSES, _location(cfg, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, True), len(classes),
            cfg.MODEL.NUM_CLASSES - len(classes), len(classes), extra=SAME_ON_EVERY_RANK,
        )  # fmt: skip


def _targets_for_task(cfg: CfgNode, base: Dataset) -> Dataset:
    """``base`` with multi-hot targets under MODEL.TASK multilabel (after any class remapping), else itself."""
    if cfg.MODEL.TASK == "multilabel":
        return MultiHotTargets(base, cfg.MODEL.NUM_CLASSES)
    if any(isinstance(t, tuple) for t in getattr(base, "targets", [])[:1]):  # a multi-label pack
        raise ConfigError("the dataset's samples have several classes each: set MODEL.TASK multilabel")
    return base


def _dataset(cfg: CfgNode, env: DistEnv, base: Dataset, transform, split: str) -> tuple[Dataset, BatchDecoder | None]:
    """The sampled dataset, and the training-process decoder when JPEGs are decoded by the batch.

    ``split`` ("train" or "val") picks the batched resample's geometry (DATA.BATCHED_AUGMENT);
    without one the per-sample ``transform`` runs on the device after the batched decode."""
    skip_bad = cfg.DATA.BAD_IMAGE == "skip"
    reader = base.base if isinstance(base, MultiHotTargets) else base
    if cfg.DATA.DECODER != "batched" or not isinstance(reader, (CheckedImageFolder, EncodedSamples, AnnotatedImages)):
        return SeededTransformDataset(base, transform, cfg.RNG_SEED, skip_bad), None
    geometry = worker_geometry = None
    if cfg.DATA.BATCHED_AUGMENT and split == "train":
        by_epoch = isinstance(transform, EpochTransforms)  # progressive resizing: the workers draw each epoch's size
        geometry, transform = batched_train_steps(cfg)
        worker_geometry = EpochTransforms(cfg, lambda size: batched_train_geometry(cfg, size)) if by_epoch else geometry
    elif cfg.DATA.BATCHED_AUGMENT and split == "val":
        geometry = worker_geometry = batched_eval_geometry(cfg)
        transform = None if geometry is not None else transform
    decoder = BatchDecoder(
        transform, env.device, skip_bad, geometry=geometry, normalize=build_normalize(cfg),
        channels_last=cfg.TRAIN.CHANNELS_LAST, max_pixels=cfg.DATA.MAX_IMAGE_PIXELS,
    )  # fmt: skip
    return EncodedImageDataset(base, cfg.RNG_SEED, skip_bad, worker_geometry, cfg.DATA.MAX_IMAGE_PIXELS), decoder


def _loader(
    cfg: CfgNode, env: DistEnv, dataset, sampler, batch_size: int, train: bool, decoder: BatchDecoder | None = None,
    epoch_transforms: EpochTransforms | None = None,
):  # fmt: skip
    workers = cfg.TRAIN.WORKERS
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=cfg.TRAIN.PIN_MEMORY and env.device.type == "cuda",
        drop_last=train,  # no tiny last batch in training (BatchNorm); eval sees every sample
        persistent_workers=workers > 0 and cfg.TRAIN.PERSISTENT_WORKERS,
        prefetch_factor=cfg.TRAIN.PREFETCH_FACTOR if workers > 0 else None,
        collate_fn=collate_skipping_bad if decoder is None else collate_encoded,
        worker_init_fn=ignore_preemption_signals,  # the trainer handles them: see runtime/faults.py
        # Its own generator, so creating an epoch's iterator does not draw from the global RNG:
        # otherwise a resumed run's random stream would drift from the uninterrupted run's.
        generator=torch.Generator().manual_seed(cfg.RNG_SEED),
    )
    return DeviceLoader(loader, env.device, build_normalize(cfg), decoder, epoch_transforms)


def build_train_split(cfg: CfgNode, env: DistEnv) -> Split:
    """Training loader: seeded per-sample augmentation, resumable DistributedSampler."""
    base, classes = _base(cfg, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, train=True)
    _warn_if_head_too_large(cfg, classes)
    transform = None if cfg.MODEL.DUMMY_INPUT else _train_transform(cfg)
    dataset, decoder = _dataset(cfg, env, _targets_for_task(cfg, base), transform, "train")
    sampler = _train_sampler(cfg, env, dataset, len(classes))
    dataset.rounds_per_epoch = getattr(sampler, "rounds_per_epoch", 1)  # how its keys' rounds count epochs
    rank_batch = global_batch(cfg.TRAIN)  # one rank's share of an optimizer step
    if len(sampler) < rank_batch:
        raise ConfigError(
            f"TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS ({rank_batch}) "
            f"exceeds the {len(sampler)} training samples each of {env.world_size} rank(s) gets"
        )
    # the batched decoder's per-sample transform, when it is progressive resizing's (BATCHED_AUGMENT False)
    by_epoch = decoder.transform if decoder is not None and isinstance(decoder.transform, EpochTransforms) else None
    loader = _loader(cfg, env, dataset, sampler, cfg.TRAIN.BATCH_SIZE, True, decoder, by_epoch)
    return Split(loader, dataset, sampler, classes)


def _train_transform(cfg: CfgNode):
    """The training transform; under progressive resizing one per size, picked by the epoch (data/progressive.py)."""
    if progressive_on(cfg.TRAIN):
        return EpochTransforms(cfg, lambda size: build_train_transform(cfg, normalize=False, size=size))
    return build_train_transform(cfg, normalize=False)


def precise_bn_indices(dataset_len: int, images: int, seed: int) -> list[int]:
    """The training samples precise BN reads: the first ``images`` of a permutation seeded by RNG_SEED
    (an ImageFolder lists its samples class by class, so its first N would be one class)."""
    return torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed))[:images].tolist()


def build_precise_bn_split(cfg: CfgNode, env: DistEnv) -> Split:
    """BN.PRECISE_IMAGES training images, in fixed batches of TRAIN.BATCH_SIZE dealt to the ranks
    (batch k to rank k mod W), read with BN.PRECISE_TRANSFORM's transform seeded per sample (epoch 0)."""
    base, classes = _base(cfg, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, train=True)
    if cfg.BN.PRECISE_IMAGES > len(base):
        raise ConfigError(
            f"BN.PRECISE_IMAGES ({cfg.BN.PRECISE_IMAGES}) exceeds the {len(base)} images of "
            f"{cfg.TRAIN.DATASET}/{cfg.TRAIN.SPLIT}"
        )
    build = build_train_transform if cfg.BN.PRECISE_TRANSFORM == "train" else build_val_transform
    transform = None if cfg.MODEL.DUMMY_INPUT else build(cfg, normalize=False)
    dataset, decoder = _dataset(cfg, env, base, transform, cfg.BN.PRECISE_TRANSFORM)
    indices = precise_bn_indices(len(base), cfg.BN.PRECISE_IMAGES, cfg.RNG_SEED)
    sampler = FixedBatchSampler(indices, cfg.TRAIN.BATCH_SIZE, env.world_size, env.rank)
    workers = cfg.TRAIN.WORKERS
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=cfg.TRAIN.PIN_MEMORY and env.device.type == "cuda",
        collate_fn=collate_skipping_bad if decoder is None else collate_encoded,
        worker_init_fn=ignore_preemption_signals,
    )  # no persistent workers: read once per evaluation, they would hold memory between
    return Split(DeviceLoader(loader, env.device, build_normalize(cfg), decoder), dataset, sampler, classes)


def _train_sampler(cfg: CfgNode, env: DistEnv, dataset: Dataset, num_classes: int) -> torch.utils.data.Sampler:
    """TRAIN.SAMPLER: shuffled (default; by windows of shards with DATA.SHUFFLE_WINDOW), repeated
    augmentation, or class-balanced draws."""
    if cfg.TRAIN.SAMPLER == "repeated":
        return RepeatedAugmentationSampler(len(dataset), env.world_size, env.rank, cfg.RNG_SEED, cfg.TRAIN.REPEATED_AUG)
    if cfg.TRAIN.SAMPLER == "weighted":
        targets = dataset_targets(dataset)
        try:
            class_weights = inverse_frequency_weights(targets, num_classes)
        except ValueError as e:
            raise ConfigError(f"TRAIN.SAMPLER weighted: {e}") from None
        return WeightedDistributedSampler(class_weights[targets], env.world_size, env.rank, cfg.RNG_SEED)
    if cfg.DATA.SHUFFLE_WINDOW:
        shards = _sample_shards(cfg, dataset)
        sampler = ShardWindowSampler(dataset, env.world_size, env.rank, cfg.RNG_SEED, shards, cfg.DATA.SHUFFLE_WINDOW)
        _bound_shard_cache(cfg, env, getattr(dataset, "base", dataset), sampler)
        return sampler
    return ResumableDistributedSampler(dataset, env.world_size, env.rank, seed=cfg.RNG_SEED)


def _sample_shards(cfg: CfgNode, dataset: Dataset) -> list[int]:
    """Each training sample's shard; a ConfigError unless TRAIN.DATASET is packed.

    An ImageFolder or a saved Hugging Face dataset is refused rather than cut into blocks of
    indices: it is read in place at random with nothing to fetch, so a window would buy nothing,
    and its indices run class by class, so blocks would cost accuracy silently.
    """
    base = getattr(dataset, "base", dataset)
    if not hasattr(base, "sample_shards"):
        raise ConfigError(
            f"DATA.SHUFFLE_WINDOW {cfg.DATA.SHUFFLE_WINDOW} needs a packed TRAIN.DATASET (tools/pack_dataset.py), "
            f"and {'synthetic data (MODEL.DUMMY_INPUT)' if cfg.MODEL.DUMMY_INPUT else cfg.TRAIN.DATASET} is not "
            "one: set DATA.SHUFFLE_WINDOW 0"
        )
    return base.sample_shards()


def _bound_shard_cache(cfg: CfgNode, env: DistEnv, base: Dataset, sampler: ShardWindowSampler) -> None:
    """DATA.SHARD_CACHE_LIMIT: read a URL's shards through a bounded node-local cache that follows
    the sampler's order (data/shard_cache.py); local shards are read in place, with nothing to cache."""
    if not cfg.DATA.SHARD_CACHE_LIMIT or not getattr(base, "remote", False):
        return
    order = ShardOrder(base.shard_samples(), cfg.RNG_SEED, cfg.DATA.SHUFFLE_WINDOW)
    depth = cfg.TRAIN.WORKERS * cfg.TRAIN.PREFETCH_FACTOR  # batches a loader may have in flight
    # The samples the node's readers may be between: the batches in flight, the one being read,
    # and one step of skew between ranks, on every rank.
    in_flight = (depth + 2) * cfg.TRAIN.BATCH_SIZE * env.world_size
    try:
        cache = ShardCache(
            base.files.cache_dir, base.shard_files(), remote.download, cfg.DATA.SHARD_CACHE_LIMIT,
            cfg.DATA.SHARD_PREFETCH, order, in_flight, env.local_rank, env.local_world_size,
        )  # fmt: skip
    except ShardCacheError as e:
        raise ConfigError(str(e)) from None
    base.read_through(cache)
    sampler.on_progress = ProgressReporter(cache, cfg.TRAIN.BATCH_SIZE, depth, env.world_size)


def dataset_targets(dataset: Dataset) -> torch.Tensor:
    """Every sample's class index, read from the dataset's labels (no image is decoded)."""
    base = getattr(dataset, "base", dataset)  # SeededTransformDataset / EncodedImageDataset wrap it
    return torch.as_tensor(base.targets, dtype=torch.int64)


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


def build_val_split(
    cfg: CfgNode, env: DistEnv, model_classes: list[str] | None = None, root: str | None = None
) -> Split:
    """Val loader of ``root`` (TEST.DATASET by default): every sample evaluated exactly once across
    ranks, its targets the model's classes.

    ``model_classes`` (the training classes, or a checkpoint's) are matched to the folder's by
    name: see data/classes.py.
    """
    root = root or cfg.TEST.DATASET
    base, classes = _base(cfg, root, cfg.TEST.SPLIT, train=False, matched=model_classes is not None)
    if model_classes is not None and not cfg.MODEL.DUMMY_INPUT:
        where = _location(cfg, root, cfg.TEST.SPLIT, train=False)
        lines = getattr(base, "label_lines", None)  # an annotation file's: its messages name the line
        remap_targets(base, map_classes(classes, list(model_classes), cfg.TEST.CLASS_OVERLAP, where, lines))
        classes = list(model_classes)
    transform = None if cfg.MODEL.DUMMY_INPUT else build_val_transform(cfg, normalize=False)
    dataset, decoder = _dataset(cfg, env, _targets_for_task(cfg, base), transform, "val")
    sampler = ExactEvalSampler(len(dataset), env.world_size, env.rank)
    loader = _loader(cfg, env, dataset, sampler, cfg.TEST.BATCH_SIZE, False, decoder)
    return Split(loader, dataset, sampler, classes)


def build_extra_val_splits(cfg: CfgNode, env: DistEnv, classes: list[str]) -> dict[str, Split]:
    """TEST.EXTRA_DATASETS as val splits named ``val_<folder name>`` (the name in metrics.jsonl and TensorBoard)."""
    splits: dict[str, Split] = {}
    for root in cfg.TEST.EXTRA_DATASETS:
        name = "val_" + re.sub(r"\W+", "_", os.path.basename(os.path.normpath(root.split(":")[-1])))
        while name in splits or name == "val":
            name += "_"
        splits[name] = build_val_split(cfg, env, classes, root)
    return splits
