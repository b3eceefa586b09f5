"""A run's data, read from the config once, where the run is set up: the train, val, extra val and
precise-BN splits (datasets, samplers, loaders), with the checks that must pass before training.
Below this line the data layer takes explicit arguments (``data/``)."""

from __future__ import annotations

import os
import re
from typing import Callable

import torch
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu.config import ConfigError
from distribuuuu.data import remote
from distribuuuu.data.annotations import AnnotationSpec
from distribuuuu.data.classes import map_classes, remap_targets
from distribuuuu.data.datasets import MultiHotTargets, SyntheticDataset, here
from distribuuuu.data.jpeg import jpeg_library
from distribuuuu.data.loader import (
    BatchedDecode,
    LoaderOptions,
    Split,
    dataset_targets,
    fixed_batch_loader,
    make_loader,
    precise_bn_indices,
    sampled_dataset,
    takes_batched_decode,
)
from distribuuuu.data.progressive import EpochTransforms
from distribuuuu.data.readers import build_base_dataset
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
from distribuuuu.data.transforms import batched_eval_geometry, batched_train_geometry, batched_train_steps
from distribuuuu.logger import SAME_ON_EVERY_RANK, get_logger
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import get_world_size, is_dist, rank0_decides
from distribuuuu.training.class_count import DUMMY_CLASSES, FROM_THE_DATA
from distribuuuu.training.preprocessing import (
    build_normalize,
    build_train_transform,
    build_val_transform,
    epoch_train_transform,
    eval_preprocessing,
    progressive,
    train_augment,
)
from distribuuuu.training.task import build_task

logger = get_logger("data")


def check_data(c: CfgNode) -> None:
    """Before any set-up: the dataset folders exist, and DATA.DECODER has its library."""
    if c.DATA.DECODER == "batched" and jpeg_library() is None:  # torchvision 0.29 deprecated its decoders
        raise ConfigError(
            "DATA.DECODER 'batched' needs TorchCodec (pip install torchcodec) or torchvision.io.decode_jpeg, gone "
            "from this torchvision"
        )
    check_dataset_paths(c)


def check_dataset_paths(c: CfgNode) -> None:
    """Raise ConfigError naming a dataset folder that does not exist (unless DUMMY_INPUT)."""
    if c.MODEL.DUMMY_INPUT:
        return
    for key, root, split, ann_file in (
        ("TRAIN.DATASET", c.TRAIN.DATASET, c.TRAIN.SPLIT, c.TRAIN.ANN_FILE),
        ("TEST.DATASET", c.TEST.DATASET, c.TEST.SPLIT, c.TEST.ANN_FILE),
        *(("TEST.EXTRA_DATASETS", extra, c.TEST.SPLIT, c.TEST.ANN_FILE) for extra in c.TEST.EXTRA_DATASETS),
    ):
        if ann_file:
            _check_annotation_paths(key, root, ann_file)
            continue
        if remote.is_remote(root):
            continue  # a packed dataset's URL: its index is read (and named if it fails) when the data is built
        kind, _, path = root.partition(":") if root.split(":", 1)[0] in ("cifar10", "cifar100") else ("", "", root)
        if kind:
            if not os.path.isdir(path):
                raise ConfigError(f"{key}: CIFAR folder not found: {path}")
            continue
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise ConfigError(f"{key}: dataset folder not found: {folder} (split {split!r})")


def _check_annotation_paths(key: str, root: str, ann_file: str) -> None:
    ann_key = key.split(".")[0] + ".ANN_FILE"
    if remote.is_remote(root) or not os.path.isdir(root):
        raise ConfigError(
            f"{key}: {ann_key} needs a local folder that its image paths are relative to, got {root!r} "
            "(pack an annotated dataset with tools/pack_dataset.py --ann-files to read it from a URL)"
        )
    path = os.path.join(root, ann_file)
    if os.path.isdir(path):
        raise ConfigError(f"{ann_key}: annotation file is a directory: {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"{ann_key}: annotation file not found: {path}")


def annotation_spec(cfg: CfgNode, train: bool) -> AnnotationSpec | None:
    """How to read TRAIN.ANN_FILE (``train``) or TEST.ANN_FILE; None when the split is a folder."""
    ann_file = cfg.TRAIN.ANN_FILE if train else cfg.TEST.ANN_FILE
    if not ann_file:
        return None
    classes_file = (
        os.path.abspath(os.path.join(cfg.TRAIN.DATASET, cfg.DATA.ANN_CLASSES)) if cfg.DATA.ANN_CLASSES else ""
    )
    label_sep = cfg.DATA.ANN_LABEL_SEP if _multilabel(cfg) else ""
    return AnnotationSpec(ann_file, cfg.DATA.ANN_HEADER, classes_file, label_sep)


def _multilabel(cfg: CfgNode) -> bool:
    """Whether the task's targets are multi-hot (``task.MultiLabel``)."""
    return build_task(cfg.MODEL, cfg.TEST).multilabel


def loader_options(cfg: CfgNode) -> LoaderOptions:
    """TRAIN.WORKERS, PIN_MEMORY, PERSISTENT_WORKERS, PREFETCH_FACTOR and RNG_SEED."""
    t = cfg.TRAIN
    return LoaderOptions(t.WORKERS, t.PIN_MEMORY, t.PERSISTENT_WORKERS, t.PREFETCH_FACTOR, cfg.RNG_SEED)


def index_decider(env: DistEnv) -> Callable:
    """Who lists a split (data/datasets.py's ``decide``): global rank 0 for all the ranks of ``env``'s
    job, which receive the arrays over the process group (one scan of a split per job, and no rank
    reads the folder's metadata but rank 0, nodes with or without a shared file system alike); a
    process alone, or one that builds its own split (``env`` of world size 1), lists it itself."""
    if env.world_size > 1 and is_dist() and get_world_size() == env.world_size:
        return rank0_decides
    return here


def _base(
    cfg: CfgNode, env: DistEnv, root: str, split: str, train: bool, matched: bool = False
) -> tuple[Dataset, list[str]]:
    """The split's dataset and classes. Its classes must fit MODEL.NUM_CLASSES unless ``matched``:
    a val split matched to the model's classes by name, where map_classes names any difference."""
    if cfg.MODEL.DUMMY_INPUT:
        count = cfg.MODEL.NUM_CLASSES or DUMMY_CLASSES
        size, classes = cfg.DATA.DUMMY_SIZE, [str(i) for i in range(count)]
        seed = cfg.RNG_SEED + (0 if train else 1)
        return SyntheticDataset(size, cfg.TRAIN.IM_SIZE, count, seed), classes
    spec = annotation_spec(cfg, train)
    base, classes = build_base_dataset(
        root,
        split,
        cfg.DATA.DECODER,
        cfg.DATA.SHARD_CACHE,
        spec,
        cfg.DATA.MAX_IMAGE_PIXELS,
        cfg.DATA.INDEX_CACHE,
        index_decider(env),
    )
    if cfg.MODEL.NUM_CLASSES != FROM_THE_DATA and len(classes) > cfg.MODEL.NUM_CLASSES and not matched:
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


def _targets_for_task(cfg: CfgNode, base: Dataset, classes: list[str]) -> Dataset:
    """``base`` with multi-hot targets for a multi-label task (after any class remapping), else itself."""
    if _multilabel(cfg):
        return MultiHotTargets(base, cfg.MODEL.NUM_CLASSES or len(classes))
    if any(isinstance(t, tuple) for t in getattr(base, "targets", [])[:1]):  # a multi-label pack
        raise ConfigError("the dataset's samples have several classes each: set MODEL.TASK multilabel")
    return base


def _dataset(cfg: CfgNode, env: DistEnv, base: Dataset, transform, split: str):
    """The sampled dataset, and the training-process decoder when JPEGs are decoded by the batch
    (DATA.DECODER batched, on a dataset of encoded files); ``split`` ("train" or "val") picks the
    batched resample's geometry (DATA.BATCHED_AUGMENT); without one the per-sample ``transform``
    runs on the device after the batched decode."""
    batched = None
    if cfg.DATA.DECODER == "batched" and takes_batched_decode(base):
        batched = _batched_decode(cfg, transform, split)
    budget = batched_memory_budget(cfg.DATA.BATCHED_MEMORY_BUDGET, env.device) if batched is not None else 0
    return sampled_dataset(
        base, transform, cfg.RNG_SEED, cfg.DATA.BAD_IMAGE == "skip", env.device, build_normalize(cfg), batched,
        cfg.TRAIN.CHANNELS_LAST, cfg.DATA.MAX_IMAGE_PIXELS, budget,
    )  # fmt: skip


def batched_memory_budget(share: float, device: torch.device) -> int:
    """DATA.BATCHED_MEMORY_BUDGET in bytes: ``share`` of the device's memory (a CPU's: the host's)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(share * total)


def _batched_decode(cfg: CfgNode, transform, split: str) -> BatchedDecode:
    """What DATA.BATCHED_AUGMENT moves into the batched resample of ``split``, and what stays per sample."""
    if cfg.DATA.BATCHED_AUGMENT and split == "train":
        geometry, tail = batched_train_steps(train_augment(cfg))
        if isinstance(transform, EpochTransforms):  # progressive resizing: the workers draw each epoch's size
            return BatchedDecode(tail, geometry, EpochTransforms(transform.schedule, _geometry_at(cfg)))
        return BatchedDecode(tail, geometry, geometry)
    if cfg.DATA.BATCHED_AUGMENT and split == "val":
        geometry = batched_eval_geometry(eval_preprocessing(cfg))
        return BatchedDecode(None if geometry is not None else transform, geometry, geometry)
    return BatchedDecode(transform)


def _geometry_at(cfg: CfgNode):
    aug = train_augment(cfg)
    return lambda size: batched_train_geometry(aug.at(size))


def train_data(cfg: CfgNode, env: DistEnv) -> tuple[Dataset, list[str]]:
    """The training split's dataset and classes, as its format lists them (class folders, annotation
    labels, a packed index, a Hugging Face ClassLabel): what MODEL.NUM_CLASSES 0 takes its count from."""
    return _base(cfg, env, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, train=True)


def train_location(cfg: CfgNode) -> str:
    """The training split as messages name it: its folder, its annotation file, or synthetic data."""
    if cfg.MODEL.DUMMY_INPUT:
        return "synthetic data (MODEL.DUMMY_INPUT)"
    return _location(cfg, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, True)


def build_train_split(cfg: CfgNode, env: DistEnv, data: tuple[Dataset, list[str]] | None = None) -> Split:
    """Training loader: seeded per-sample augmentation, resumable DistributedSampler (of ``data``,
    ``train_data``'s, when already read)."""
    base, classes = data or train_data(cfg, env)
    _warn_if_head_too_large(cfg, classes)
    transform = None if cfg.MODEL.DUMMY_INPUT else epoch_train_transform(cfg)
    dataset, decoder = _dataset(cfg, env, _targets_for_task(cfg, base, classes), transform, "train")
    sampler = _train_sampler(cfg, env, dataset, len(classes))
    dataset.rounds_per_epoch = getattr(sampler, "rounds_per_epoch", 1)  # how its keys' rounds count epochs
    rank_batch = cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS  # one rank's share of an optimizer step
    if len(sampler) < rank_batch:
        raise ConfigError(
            f"TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS ({rank_batch}) "
            f"exceeds the {len(sampler)} training samples each of {env.world_size} rank(s) gets"
        )
    # the batched decoder's per-sample transform, when it is progressive resizing's (BATCHED_AUGMENT False)
    by_epoch = decoder.transform if decoder is not None and isinstance(decoder.transform, EpochTransforms) else None
    loader = make_loader(
        dataset, sampler, cfg.TRAIN.BATCH_SIZE, env.device, build_normalize(cfg), loader_options(cfg), True, decoder,
        by_epoch,
    )  # fmt: skip
    return Split(loader, dataset, sampler, classes)


def build_precise_bn_split(cfg: CfgNode, env: DistEnv) -> Split:
    """BN.PRECISE_IMAGES training images, in fixed batches of TRAIN.BATCH_SIZE dealt to the ranks
    (batch k to rank k mod W), read with BN.PRECISE_TRANSFORM's transform seeded per sample (epoch 0)."""
    base, classes = _base(cfg, env, cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, train=True)
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
    loader = fixed_batch_loader(dataset, sampler, env.device, build_normalize(cfg), loader_options(cfg), decoder)
    return Split(loader, dataset, sampler, classes)


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


def build_val_split(
    cfg: CfgNode, env: DistEnv, model_classes: list[str] | None = None, root: str | None = None
) -> Split:
    """Val loader of ``root`` (TEST.DATASET by default): every sample evaluated exactly once across
    ranks, its targets the model's classes.

    ``model_classes`` (the training classes, or a checkpoint's) are matched to the folder's by
    name: see data/classes.py.
    """
    root = root or cfg.TEST.DATASET
    base, classes = _base(cfg, env, root, cfg.TEST.SPLIT, train=False, matched=model_classes is not None)
    if model_classes is not None and not cfg.MODEL.DUMMY_INPUT:
        where = _location(cfg, root, cfg.TEST.SPLIT, train=False)
        lines = getattr(base, "label_lines", None)  # an annotation file's: its messages name the line
        remap_targets(base, map_classes(classes, list(model_classes), cfg.TEST.CLASS_OVERLAP, where, lines))
        classes = list(model_classes)
    transform = None if cfg.MODEL.DUMMY_INPUT else build_val_transform(cfg, normalize=False)
    dataset, decoder = _dataset(cfg, env, _targets_for_task(cfg, base, classes), transform, "val")
    sampler = ExactEvalSampler(len(dataset), env.world_size, env.rank)
    loader = make_loader(
        dataset, sampler, cfg.TEST.BATCH_SIZE, env.device, build_normalize(cfg), loader_options(cfg), False, decoder
    )
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


__all__ = [
    "build_extra_val_splits",
    "build_precise_bn_split",
    "build_train_split",
    "build_val_split",
    "check_data",
    "check_dataset_paths",
    "progressive",
    "train_data",
    "train_location",
]
