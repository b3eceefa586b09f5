"""Samplers: a resumable, epoch-keyed training sampler and an exact (unpadded) eval sampler."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that yields ``(epoch, index)`` keys and can start mid-epoch.

    The epoch in each key lets the dataset seed every sample's augmentation from (seed, epoch,
    index) alone, even inside persistent workers that never see ``set_epoch``; ``set_start``
    skips the samples a resumed epoch already trained on. DistributedSampler's own shuffling and
    padding are kept unchanged (the padding duplicates are harmless for training).
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` samples of this rank's shard in the current epoch."""
        self.start = start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = list(super().__iter__())[self.start :]
        return iter([(self.epoch, i) for i in indices])

    def __len__(self) -> int:
        return self.num_samples - self.start


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
