"""The training sampler resumes from a global position, so a resume on another world size is exact.

Ranks are simulated in one process: a "run" of W ranks builds W samplers and each rank takes the
full batches the DataLoader (drop_last=True) would give it. ``window`` > 0 runs the same checks on
the shard-windowed order (DATA.SHUFFLE_WINDOW) over shards of SHARD consecutive samples.
"""

from __future__ import annotations

import pytest
from sampler_helpers import window_stretches
from torch.utils.data import DistributedSampler

from distribuuuu.data.samplers import ResumableDistributedSampler, ShardWindowSampler

SEED = 7
SHARD = 7  # samples per shard in the windowed cases; the last shard holds the rest
WINDOWS = [0, 1, 3]


def sample_shards(n: int) -> list[int]:
    return [i // SHARD for i in range(n)]


def samplers(n: int, world: int, epoch: int, position: int = 0, window: int = 0) -> list[ResumableDistributedSampler]:
    result = []
    for rank in range(world):
        if window:
            s = ShardWindowSampler(range(n), world, rank, SEED, sample_shards(n), window)
        else:
            s = ResumableDistributedSampler(range(n), world, rank, seed=SEED)
        s.set_epoch(epoch)
        s.set_position(position)
        result.append(s)
    return result


def consume(
    n: int, world: int, batch: int, epoch: int, position: int, steps: int | None = None, window: int = 0
) -> list[int]:
    """Indices the W ranks train on in ``steps`` steps (all full steps if None), in global order."""
    shards = [[i for _, i in s] for s in samplers(n, world, epoch, position, window)]
    full_steps = len(shards[0]) // batch  # drop_last=True: what steps_per_epoch counts
    steps = full_steps if steps is None else steps
    assert steps <= full_steps
    # Step s of rank r covers global positions position + (s*batch + j)*world + r, j < batch.
    return [shards[r][s * batch + j] for s in range(steps) for j in range(batch) for r in range(world)]


@pytest.mark.parametrize("n", [1, 10, 97, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_order_is_distributed_samplers_from_the_start_and_on_same_world_size_resume(n, world):
    for rank in range(world):
        reference = DistributedSampler(range(n), world, rank, shuffle=True, seed=SEED)
        reference.set_epoch(3)
        expected = list(reference)
        for skipped in range(len(expected) + 1):
            s = samplers(n, world, epoch=3, position=0)[rank]
            s.set_start(skipped)  # what the trainer calls today: samples of this rank's shard
            assert [i for _, i in s] == expected[skipped:]
            assert len(s) == len(expected) - skipped


@pytest.mark.parametrize("window", WINDOWS)
def test_permutation_depends_on_seed_and_epoch_only(window):
    orders = {w: samplers(50, w, epoch=2, window=window)[0].permutation() for w in (1, 2, 5)}
    assert orders[1] == orders[2] == orders[5]
    assert sorted(orders[1]) == list(range(50))
    assert samplers(50, 1, epoch=3, window=window)[0].permutation() != orders[1]


@pytest.mark.parametrize("n", [50, 97, 100])
@pytest.mark.parametrize("window", [1, 2, 3, 20])
def test_windowed_order_reads_the_shards_window_by_window(n, window):
    """Windows of shards one after the other; within a window its shards are mixed, not read one
    after the other; each epoch visits the shards in another order."""
    shard_of = sample_shards(n)
    first_visits, switches, shard_after_shard = [], 0, 0
    for epoch in range(4):
        order = samplers(n, 1, epoch, window=window)[0].permutation()
        for stretch in window_stretches(order, shard_of, window):
            shards = [shard_of[i] for i in stretch]
            switches += sum(a != b for a, b in zip(shards, shards[1:]))
            shard_after_shard += len(set(shards)) - 1  # the switches of a window read one shard at a time
        first_visits.append(list(dict.fromkeys(shard_of[i] for i in order)))
    assert switches > 2 * shard_after_shard or window == 1, "the window's samples are shuffled together"
    if n // SHARD > 1:
        assert len({tuple(v) for v in first_visits}) > 1, "the shard order is drawn anew each epoch"
    equal = [i // SHARD for i in range(window * SHARD * (n // (window * SHARD)))]  # whole windows of whole shards
    if equal:  # then window k is exactly positions [k * window * SHARD, (k + 1) * window * SHARD)
        order = samplers(len(equal), 1, 0, window=window)[0].permutation()
        assert [len(s) for s in window_stretches(order, equal, window)] == [window * SHARD] * (n // (window * SHARD))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    ("n", "batch", "before", "after", "steps_before"),
    [(103, 4, 2, 3, 5), (100, 3, 3, 1, 4), (100, 3, 3, 2, 7), (64, 4, 2, 4, 3), (50, 2, 1, 3, 0)],
)
def test_resume_on_another_world_size_uses_every_sample_once(n, batch, before, after, steps_before, window):
    """W ranks train k steps, W' ranks the rest of the epoch: no sample twice, none skipped.

    drop_last semantics: the loader drops each rank's last partial batch, so the final fewer than
    W'·batch positions of the epoch (and any of the fewer than W' padding duplicates among them)
    are not trained on, as in an uninterrupted run; every other sample is used exactly once.
    """
    epoch = 4
    first = consume(n, before, batch, epoch, 0, steps_before, window)
    position = len(first)  # = steps_before * batch * before: what a checkpoint records
    second = consume(n, after, batch, epoch, position, window=window)
    order = samplers(n, 1, epoch, window=window)[0].permutation()
    used = first + second
    assert used == order[: len(used)]  # contiguous in the epoch's permutation: nothing twice or skipped
    assert len(set(used)) == len(used)
    assert n - len(used) < after * batch  # only the last partial global batch is left out


def test_negative_position_is_refused_and_a_finished_epoch_is_empty():
    s = ResumableDistributedSampler(range(10), 2, 0, seed=SEED)
    with pytest.raises(ValueError, match=">= 0"):
        s.set_position(-1)
    s.set_position(10)
    assert len(s) == 0 and list(s) == []
