"""Samplers: resumable, epoch-keyed training samplers (plain, shard-windowed, repeated augmentation,
weighted) and an exact (unpadded) eval sampler."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that yields ``(epoch, index)`` keys and can start mid-epoch.

    The epoch in each key lets the dataset seed every sample's augmentation from (seed, epoch,
    index) alone, even inside persistent workers that never see ``set_epoch``.

    An epoch is one permutation of the dataset that depends on (seed, epoch) only, never on the
    world size. A resumed epoch starts at a *global* position P of that permutation: rank r of W
    takes positions P + r, P + r + W, P + r + 2W, ... to the end of the epoch. So the positions a
    run of W ranks consumed before a checkpoint and those a run of W' ranks consumes after it are
    disjoint and contiguous, whatever W and W' are. As DistributedSampler does, the tail is padded
    to a multiple of W with the permutation's first samples (fewer than W duplicates), so every
    rank gets the same count; for P = 0, and for P a multiple of W (``set_start``, a resume on the
    same world size), the order is exactly DistributedSampler's, as before.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.position = 0  # global position in the epoch's permutation where iteration starts

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` samples of this rank's shard (a resume on the same world size)."""
        self.set_position(start * self.num_replicas)

    def set_position(self, position: int) -> None:
        """Start at global position ``position`` of the epoch's permutation (samples all ranks consumed)."""
        if position < 0:
            raise ValueError(f"sampler position must be >= 0, got {position}")
        self.position = position

    def permutation(self) -> list[int]:
        """The epoch's order of sample indices: a function of (seed, epoch) alone."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # DistributedSampler's seeding, so orders match today's
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = self.permutation()
        # Positions past the end wrap to the permutation's start: that is DistributedSampler's padding.
        end = self.position + len(self) * self.num_replicas
        positions = range(self.position + self.rank, end, self.num_replicas)
        return iter([(self.epoch, order[p % len(order)]) for p in positions])

    def __len__(self) -> int:
        return max(0, math.ceil((len(self.dataset) - self.position) / self.num_replicas))


def shuffled_shards(num_shards: int, generator: torch.Generator) -> torch.Tensor:
    """The shards of an epoch in the order its windows read them: the first draw of the epoch's generator."""
    return torch.randperm(num_shards, generator=generator)


def shard_window_order(sample_shards: torch.Tensor, window: int, generator: torch.Generator) -> torch.Tensor:
    """Shuffle the shards, then the samples within each run of ``window`` consecutive shuffled shards.

    ``sample_shards[i]`` is the shard that sample i is read from. The result lists every sample
    index once, window after window: all samples of the first ``window`` shards (in the shuffled
    shard order) in a random order, then those of the next ``window`` shards, and so on.
    """
    num_shards = int(sample_shards.max()) + 1 if len(sample_shards) else 0
    shard_position = torch.empty(num_shards, dtype=torch.int64)
    shard_position[shuffled_shards(num_shards, generator)] = torch.arange(num_shards)
    windows = shard_position[sample_shards] // window
    # Sorting by (window, a random permutation of all samples) keeps the windows in order and puts
    # each window's samples in a uniformly random order, in one vectorised sort (ImageNet: 1.3M).
    tiebreak = torch.randperm(len(sample_shards), generator=generator)
    return torch.argsort(windows * len(sample_shards) + tiebreak)


class ShardWindowSampler(ResumableDistributedSampler):
    """ResumableDistributedSampler whose epoch order reads few shards at a time (DATA.SHUFFLE_WINDOW).

    The order is ``shard_window_order`` of (seed, epoch): the shards shuffled, then the samples
    of each window of ``window`` consecutive shards shuffled together. It is still a permutation
    that depends on (seed, epoch) alone, so every guarantee of the parent holds unchanged (each
    sample once, the same order on any world size, resume at a global position). The ranks
    split it by position as before (rank r of N takes P + r, P + r + N, ...): a global batch is a run
    of consecutive positions, so all ranks and their workers read the same window at the same
    time, at most ``window`` shards (two windows' across a boundary) instead of nearly every
    shard, and a machine's shard cache fetches each shard once, when its window comes.
    Contiguous blocks per rank would spread the ranks over as many windows as there are ranks,
    and the samples consumed before a checkpoint would no longer be a prefix of the order.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, sample_shards, window: int):
        if window < 1:
            raise ValueError(f"shard window must be >= 1, got {window}")
        if len(sample_shards) != len(dataset):
            raise ValueError(f"{len(sample_shards)} shard numbers for {len(dataset)} samples")
        super().__init__(dataset, num_replicas, rank, seed)
        self.sample_shards = torch.as_tensor(sample_shards, dtype=torch.int64)
        self.window = window
        # Told (epoch, start position, keys handed out) as the loader takes keys: a bounded shard
        # cache follows the order with it (data/shard_cache.py). None: nothing is told.
        self.on_progress: Callable[[int, int, int], None] | None = None

    def permutation(self) -> list[int]:
        """The epoch's order: a function of (seed, epoch) alone, window after window of shards."""
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return shard_window_order(self.sample_shards, self.window, g).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        keys = super().__iter__()
        return keys if self.on_progress is None else self._reporting(keys, self.on_progress)

    def _reporting(self, keys: Iterator[tuple[int, int]], report: Callable[[int, int, int], None]):
        epoch, start = self.epoch, self.position
        report(epoch, start, 0)  # before the first key: a new epoch starts at its position
        for handed_out, key in enumerate(keys):
            report(epoch, start, handed_out)
            yield key


class ExactEvalSampler(Sampler[int]):
    """Give every sample to exactly one rank: rank r takes indices r, r+W, r+2W, ...

    Written here because DistributedSampler pads the dataset with duplicates so every rank gets
    the same count, which makes accuracy depend on the number of processes. Ranks may get one
    sample more or less; evaluation runs without DDP, so uneven shards cannot deadlock.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int):
        self.indices = range(rank, dataset_len, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class FixedBatchSampler(Sampler[list[int]]):
    """Cut ``indices`` into fixed batches of ``batch_size`` (the last may be smaller) and give
    batch k to rank k mod W: every batch is the same whatever the world size (precise BN)."""

    def __init__(self, indices: list[int], batch_size: int, num_replicas: int, rank: int):
        batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
        self.batches = batches[rank::num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def occurrence_numbers(draws: torch.Tensor) -> torch.Tensor:
    """For each position of ``draws``, how many earlier positions hold the same index (0, 1, 2, ...)."""
    order = torch.argsort(draws, stable=True)
    ranked = draws[order]
    positions = torch.arange(len(draws))
    starts = torch.ones(len(draws), dtype=torch.bool)
    starts[1:] = ranked[1:] != ranked[:-1]
    run_start = torch.cummax(torch.where(starts, positions, 0), dim=0).values
    numbers = torch.empty_like(positions)
    numbers[order] = positions - run_start
    return numbers


class _RepeatingDistributedSampler(Sampler[tuple[int, int]], abc.ABC):
    """Shard one seeded global draw per epoch by position (rank r takes P + r, P + r + W, ...),
    resumable at a global position P on any world size.

    The epoch's draw is ``epoch_length`` dataset indices, a function of (seed, epoch) and the
    dataset alone, never of the world size: as ResumableDistributedSampler's permutation, so a run
    of W ranks and a run of W' ranks resumed at P consume contiguous, disjoint stretches of one
    sequence. The tail is padded to a multiple of W with the sequence's first keys (fewer than W),
    as DistributedSampler pads. A sample drawn several times in an epoch must be augmented
    differently each time, but SeededTransformDataset seeds from the key ``(epoch, index)``. So the
    first element of each key is an augmentation round, ``epoch * rounds_per_epoch + occurrence``:
    distinct for every copy in every epoch, and equal to the epoch when nothing repeats, as with
    the plain sampler.
    """

    rounds_per_epoch = 1

    def __init__(self, epoch_length: int, num_replicas: int, rank: int, seed: int):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.epoch_length, self.num_replicas, self.rank, self.seed = epoch_length, num_replicas, rank, seed
        self.epoch = self.position = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` samples of this rank's shard (a resume on the same world size)."""
        self.set_position(start * self.num_replicas)

    def set_position(self, position: int) -> None:
        """Start at global position ``position`` of the epoch's draw (samples all ranks consumed)."""
        if position < 0:
            raise ValueError(f"sampler position must be >= 0, got {position}")
        self.position = position

    @abc.abstractmethod
    def _draw(self, generator: torch.Generator, total: int) -> torch.Tensor:
        """The epoch's ``total`` global draws of dataset indices."""

    def keys(self) -> list[tuple[int, int]]:
        """The epoch's global sequence of ``(round, index)`` keys: a function of (seed, epoch) alone."""
        draws = self._draw(torch.Generator().manual_seed(self.seed + self.epoch), self.epoch_length)
        rounds = self.epoch * self.rounds_per_epoch + occurrence_numbers(draws)
        return list(zip(rounds.tolist(), draws.tolist()))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        keys = self.keys()
        end = self.position + len(self) * self.num_replicas  # past the end: wrapped, DistributedSampler's padding
        return iter([keys[p % len(keys)] for p in range(self.position + self.rank, end, self.num_replicas)])

    def __len__(self) -> int:
        return max(0, math.ceil((self.epoch_length - self.position) / self.num_replicas))


class RepeatedAugmentationSampler(_RepeatingDistributedSampler):
    """Repeated augmentation (Hoffer et al., 2020; DeiT, timm's ``RASampler``): each drawn sample
    appears ``repeats`` times in an epoch, each copy on the next rank and with its own augmentation.

    As in timm, an epoch keeps its usual length, ``dataset_len`` draws over all ranks: it uses
    about ``1 / repeats`` of the dataset, and the last sample drawn may be cut short of its
    repeats. The draw is the same on any world size, so the copies of a sample sit on consecutive
    global positions (on ``repeats`` different ranks when there are at least that many) and a
    resume on another world size is exact. Written here (timm is optional, and its sampler neither
    yields seeded keys nor resumes mid-epoch, and its draw depends on the world size).
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, seed: int, repeats: int = 3):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        super().__init__(dataset_len, num_replicas, rank, seed)
        self.dataset_len, self.rounds_per_epoch = dataset_len, repeats

    def _draw(self, generator: torch.Generator, total: int) -> torch.Tensor:
        picked = torch.randperm(self.dataset_len, generator=generator)[: -(-total // self.rounds_per_epoch)]
        return picked.repeat_interleave(self.rounds_per_epoch)[:total]


def inverse_frequency_weights(targets: Sequence[int] | torch.Tensor, num_classes: int) -> torch.Tensor:
    """Weight each class by ``N / (C * count)`` (scikit-learn's "balanced"): the mean weight per sample is 1.

    A class without samples is an error: its weight would be infinite.
    """
    counts = torch.bincount(torch.as_tensor(targets, dtype=torch.int64), minlength=num_classes)
    if len(counts) > num_classes:
        raise ValueError(f"targets go up to {len(counts) - 1} but there are {num_classes} classes")
    empty = torch.nonzero(counts == 0).flatten().tolist()
    if empty:
        raise ValueError(f"class weights: classes {empty} have no samples")
    return (counts.sum() / (num_classes * counts.double())).float()


class WeightedDistributedSampler(_RepeatingDistributedSampler):
    """Draw ``num_samples`` indices per epoch with replacement, in proportion to ``weights``, shared by rank.

    For class-imbalanced data: per-sample weights such as ``inverse_frequency_weights(t, C)[t]``
    make every class equally likely. Written here because PyTorch's WeightedRandomSampler is not
    distributed: every rank would need the same draw and its own share of it.
    """

    def __init__(self, weights, num_replicas: int, rank: int, seed: int, num_samples: int | None = None) -> None:
        self.weights = torch.as_tensor(weights, dtype=torch.float64)
        total = len(self.weights) if num_samples is None else num_samples
        super().__init__(total, num_replicas, rank, seed)
        self.rounds_per_epoch = total  # no index can be drawn more often than that

    def _draw(self, generator: torch.Generator, total: int) -> torch.Tensor:
        return torch.multinomial(self.weights, total, replacement=True, generator=generator)
