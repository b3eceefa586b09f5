"""Repeated-augmentation and weighted samplers, every rank simulated in one process.

The ranks' shards are interleaved back into the epoch's global sequence and checked against what
the sampler promises (repeat counts, one multinomial draw recomputed here), and a resumed epoch
against the tail of the uninterrupted one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torchvision
from helpers import REPO
from sampler_helpers import RESUME_AT, config_sampler_keys

from distribuuuu.data.samplers import (
    RepeatedAugmentationSampler,
    WeightedDistributedSampler,
    inverse_frequency_weights,
    occurrence_numbers,
)


def _shards(make, world: int, epoch: int) -> list[list[tuple[int, int]]]:
    shards = []
    for rank in range(world):
        sampler = make(world, rank)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert len(shards[-1]) == len(sampler)
    return shards


def _interleave(shards: list[list]) -> list:
    """The global sequence: position p was given to rank p % W as its (p // W)-th sample."""
    return [shard[i] for i in range(len(shards[0])) for shard in shards]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dataset_len", [30, 31])
def test_repeated_augmentation_repeats_each_sample_k_times_across_ranks(world, dataset_len):
    k = 3
    shards = _shards(lambda w, r: RepeatedAugmentationSampler(dataset_len, w, r, seed=7, repeats=k), world, epoch=2)
    assert {len(s) for s in shards} == {-(-dataset_len // world)}  # DistributedSampler's epoch length per rank
    padded = _interleave(shards)
    keys = padded[:dataset_len]  # the epoch: the rest wraps to its start, as DistributedSampler pads
    assert padded[dataset_len:] == keys[: len(padded) - dataset_len]
    counts = Counter(index for _, index in keys)
    last = keys[-1][1]
    assert all(c == k for i, c in counts.items() if i != last) and 1 <= counts[last] <= k
    assert len(counts) == -(-len(keys) // k)  # about 1 / k of the dataset, no index drawn twice over
    # The copies of a sample are consecutive: on k different ranks when there are k ranks, and
    # each with its own augmentation round (2 x k + copy number) and so its own seed.
    for position, (round_, index) in enumerate(keys):
        first = keys.index(next(key for key in keys if key[1] == index))
        assert round_ == 2 * k + position - first
    if world == k:
        for index in counts:
            ranks = [p % world for p, (_, i) in enumerate(keys) if i == index]
            assert len(set(ranks)) == len(ranks)


def _repeated(n: int, world: int, rank: int) -> RepeatedAugmentationSampler:
    return RepeatedAugmentationSampler(n, world, rank, seed=5, repeats=3)


def _weighted(n: int, world: int, rank: int) -> WeightedDistributedSampler:
    weights = torch.rand(n, generator=torch.Generator().manual_seed(2)).double()
    return WeightedDistributedSampler(weights, world, rank, seed=5)


@pytest.mark.parametrize("make", [_repeated, _weighted], ids=["repeated", "weighted"])
@pytest.mark.parametrize("n", [30, 31, 97])
def test_the_epochs_sequence_of_keys_is_the_same_on_any_world_size(make, n):
    """What the ranks take together, interleaved back, is one sequence: that of one rank."""
    one_rank = _interleave(_shards(lambda w, r: make(n, w, r), 1, epoch=3))
    assert len(one_rank) == n
    for world in (2, 3, 4):
        assert _interleave(_shards(lambda w, r: make(n, w, r), world, epoch=3))[:n] == one_rank, world
    assert _interleave(_shards(lambda w, r: make(n, w, r), 1, epoch=4)) != one_rank


def _consume(make, n: int, world: int, batch: int, epoch: int, position: int, steps: int | None = None) -> list:
    """The keys W ranks train on (whole batches, drop_last) from global ``position``, in global order."""
    shards = []
    for rank in range(world):
        sampler = make(n, world, rank)
        sampler.set_epoch(epoch)
        sampler.set_position(position)
        shards.append(list(sampler))
    full_steps = len(shards[0]) // batch
    steps = full_steps if steps is None else steps
    return [shards[r][s * batch + j] for s in range(steps) for j in range(batch) for r in range(world)]


@pytest.mark.parametrize("make", [_repeated, _weighted], ids=["repeated", "weighted"])
@pytest.mark.parametrize(
    ("n", "batch", "before", "after", "steps_before"), [(103, 4, 2, 3, 5), (100, 3, 3, 1, 4), (64, 4, 2, 4, 3)]
)
def test_repeated_and_weighted_samplers_resume_on_another_world_size_exactly(
    make, n, batch, before, after, steps_before
):
    """W ranks train k steps, W' ranks the rest of the epoch: together the uninterrupted sequence's keys,
    each once, the copies of a repeated sample with their own rounds as before the resume."""
    first = _consume(make, n, before, batch, 4, 0, steps_before)
    second = _consume(make, n, after, batch, 4, len(first))  # len(first): the position a checkpoint records
    whole = _interleave(_shards(lambda w, r: make(n, w, r), 1, epoch=4))
    used = first + second
    assert used == whole[: len(used)]
    assert len(set(used)) == len(used)  # no key twice: every copy its own augmentation round
    assert n - len(used) < after * batch  # only the last partial global batch is left out


def test_repeated_augmentation_is_deterministic_per_epoch_and_resumes_mid_epoch():
    def make(epoch: int, start: int = 0) -> list:
        sampler = RepeatedAugmentationSampler(40, 2, 1, seed=3, repeats=2)
        sampler.set_epoch(epoch)
        sampler.set_start(start)
        assert len(sampler) == 20 - start
        return list(sampler)

    assert make(4) == make(4) and make(4) != make(5)
    assert make(4, start=7) == make(4)[7:]


def test_one_repeat_draws_a_permutation_keyed_by_the_epoch():
    keys = _interleave(_shards(lambda w, r: RepeatedAugmentationSampler(12, w, r, seed=0, repeats=1), 3, epoch=5))
    assert sorted(index for _, index in keys) == list(range(12))
    assert {round_ for round_, _ in keys} == {5}


def test_occurrence_numbers_count_earlier_copies():
    draws = torch.tensor([4, 1, 4, 4, 0, 1])
    assert occurrence_numbers(draws).tolist() == [0, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_weighted_sampler_ranks_share_one_global_multinomial_draw(world):
    weights = torch.rand(50, generator=torch.Generator().manual_seed(1)).double()
    shards = _shards(lambda w, r: WeightedDistributedSampler(weights, w, r, seed=9, num_samples=60), world, epoch=3)
    keys = _interleave(shards)
    expected = torch.multinomial(weights, 60, replacement=True, generator=torch.Generator().manual_seed(9 + 3))
    assert [index for _, index in keys] == expected[: len(keys)].tolist()
    assert len(set(keys)) == len(keys)  # a sample drawn twice gets another augmentation round


def test_weighted_sampler_balances_imbalanced_classes_and_resumes():
    targets = torch.tensor([0] * 900 + [1] * 80 + [2] * 20)  # 90% / 8% / 2%
    weights = inverse_frequency_weights(targets, 3)[targets]
    drawn = Counter()
    for epoch in range(5):
        for rank in range(2):
            sampler = WeightedDistributedSampler(weights, 2, rank, seed=0)
            sampler.set_epoch(epoch)
            drawn.update(int(targets[i]) for _, i in sampler)
    total = sum(drawn.values())
    assert total == 5 * 1000
    for c in range(3):  # each class a third of the draws; the binomial std is 0.0067
        assert abs(drawn[c] / total - 1 / 3) < 0.03, drawn
    sampler = WeightedDistributedSampler(weights, 2, 1, seed=0)
    full = list(sampler)
    sampler.set_start(123)
    assert list(sampler) == full[123:]


def test_copies_of_a_sample_are_augmented_differently_and_reproducibly():
    from distribuuuu.data.datasets import SeededTransformDataset

    base = [(torch.zeros(2), 0)] * 6
    dataset = SeededTransformDataset(base, lambda x: x + torch.rand(2), seed=1)  # draws from the seeded CPU RNG
    sampler = RepeatedAugmentationSampler(6, 1, 0, seed=0, repeats=3)
    keys = list(sampler)
    images = [dataset[key][0] for key in keys[:3]]  # the three copies of the first sample drawn
    assert len({key[1] for key in keys[:3]}) == 1
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    assert torch.equal(images[1], dataset[keys[1]][0])


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_augmentation_of_a_real_config_repeats_each_sample_k_times_across_the_ranks_and_resumes(world):
    """Every rank's sampler built from TRAIN.SAMPLER repeated by load_cfg and build_train_split on
    the digits (1436 images, divisible by neither 3 nor 2 x 3 = 6)."""
    k, digits = 3, REPO / "data" / "digits"
    opts = ["TRAIN.SAMPLER", "repeated", "TRAIN.REPEATED_AUG", str(k), "TRAIN.DATASET", str(digits)]
    ranks = config_sampler_keys(opts, world)
    train_len = len(torchvision.datasets.ImageFolder(digits / "train"))
    for epoch in (0, 1):
        shards = [rank[epoch] for rank in ranks]
        assert [len(s) for s in shards] == [-(-train_len // world)] * world
        keys = _interleave(shards)[:train_len]  # past it: the padding, the epoch's first keys again
        counts = Counter(index for _, index in keys)
        last = keys[-1][1]
        assert all(c == k for i, c in counts.items() if i != last) and 1 <= counts[last] <= k
        assert len(set(keys)) == len(keys)  # each copy its own augmentation round: no two seeds alike
        assert {r for r, _ in keys} == set(range(epoch * k, epoch * k + k))
        for index, count in counts.items():  # consecutive copies: on as many ranks as there are copies
            assert len({p % world for p, (_, i) in enumerate(keys) if i == index}) == min(count, world)
    for rank in ranks:  # a resumed epoch continues exactly where the uninterrupted one was
        assert rank["resumed"] == rank[1][RESUME_AT:]
