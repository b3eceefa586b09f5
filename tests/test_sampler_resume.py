"""The training sampler resumes from a global position, so a resume on another world size is exact.

Ranks are simulated in one process: a "run" of W ranks builds W samplers and each rank takes the
full batches the DataLoader (drop_last=True) would give it.
"""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from distribuuuu.data.samplers import ResumableDistributedSampler

SEED = 7


def samplers(n: int, world: int, epoch: int, position: int = 0) -> list[ResumableDistributedSampler]:
    result = []
    for rank in range(world):
        s = ResumableDistributedSampler(range(n), world, rank, seed=SEED)
        s.set_epoch(epoch)
        s.set_position(position)
        result.append(s)
    return result


def consume(n: int, world: int, batch: int, epoch: int, position: int, steps: int | None = None) -> list[int]:
    """Indices the W ranks train on in ``steps`` steps (all full steps if None), in global order."""
    shards = [[i for _, i in s] for s in samplers(n, world, epoch, position)]
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


def test_permutation_depends_on_seed_and_epoch_only():
    orders = {w: samplers(50, w, epoch=2)[0].permutation() for w in (1, 2, 5)}
    assert orders[1] == orders[2] == orders[5]
    assert sorted(orders[1]) == list(range(50))
    assert samplers(50, 1, epoch=3)[0].permutation() != orders[1]


@pytest.mark.parametrize(
    ("n", "batch", "before", "after", "steps_before"),
    [(103, 4, 2, 3, 5), (100, 3, 3, 1, 4), (100, 3, 3, 2, 7), (64, 4, 2, 4, 3), (50, 2, 1, 3, 0)],
)
def test_resume_on_another_world_size_uses_every_sample_once(n, batch, before, after, steps_before):
    """W ranks train k steps, W' ranks the rest of the epoch: no sample twice, none skipped.

    drop_last semantics: the loader drops each rank's last partial batch, so the final fewer than
    W'·batch positions of the epoch (and any of the fewer than W' padding duplicates among them)
    are not trained on, as in an uninterrupted run; every other sample is used exactly once.
    """
    epoch = 4
    first = consume(n, before, batch, epoch, 0, steps_before)
    position = len(first)  # = steps_before * batch * before: what a checkpoint records
    second = consume(n, after, batch, epoch, position)
    order = samplers(n, 1, epoch)[0].permutation()
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
