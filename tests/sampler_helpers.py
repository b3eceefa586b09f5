"""Sampler checks shared by the sampler, packed-data and shard-cache tests: an epoch's order cut into
its shard windows, and every rank's training sampler of a real config built in this process."""

from __future__ import annotations

from distribuuuu.config import load_cfg
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split


def window_stretches(order: list[int], shard_of: list[int], window: int) -> list[list[int]]:
    """Split an epoch's order into its windows, asserting that it is made of windows.

    The shards, in the order the epoch first reaches them, taken ``window`` at a time, are the
    windows: each window's samples must fill one contiguous stretch of the order (so any point
    of the epoch reads at most ``window`` shards) and hold every sample of its shards.
    """
    assert sorted(order) == list(range(len(shard_of))), "each sample exactly once"
    visited = list(dict.fromkeys(shard_of[i] for i in order))  # shards in order of first appearance
    window_of = {shard: k // window for k, shard in enumerate(visited)}
    windows = [window_of[shard_of[i]] for i in order]
    assert windows == sorted(windows), "a window's samples are contiguous: no shard comes back later"
    stretches, start = [], 0
    for k in range(max(windows, default=-1) + 1):
        stretch = order[start : start + windows.count(k)]
        shards = set(visited[k * window : (k + 1) * window])
        assert {shard_of[i] for i in stretch} == shards
        assert sorted(stretch) == [i for i, shard in enumerate(shard_of) if shard in shards], "whole shards"
        stretches.append(stretch)
        start += len(stretch)
    return stretches


RESUME_AT = 5  # samples of one rank into epoch 1


def config_sampler_keys(opts: list[str], world: int) -> list[dict]:
    """Every rank's training sampler of a real config (load_cfg, build_train_split with that rank's
    DistEnv, as training builds it), all built in this process: the data code takes no collective.
    Per rank, its ``(round, index)`` keys of epochs 0 and 1, and "resumed": epoch 1 from a sampler
    built anew (as after a restart) and started after RESUME_AT samples."""
    ranks = []
    for rank in range(world):
        env, keys = DistEnv(rank=rank, world_size=world), {}
        sampler = build_train_split(load_cfg(opts=opts), env).sampler
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            sampler.set_start(0)
            keys[epoch] = [tuple(key) for key in sampler]
        resumed = build_train_split(load_cfg(opts=opts), env).sampler
        resumed.set_epoch(1)
        resumed.set_start(RESUME_AT)
        keys["resumed"] = [tuple(key) for key in resumed]
        ranks.append(keys)
    return ranks
