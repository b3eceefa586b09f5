"""Samplers: a resumable, epoch-keyed training sampler and an exact (unpadded) eval sampler."""

from __future__ import annotations

import math
from collections.abc import Iterator

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
