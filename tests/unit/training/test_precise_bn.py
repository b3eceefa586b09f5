"""Precise BatchNorm (BN.PRECISE_IMAGES): running statistics recomputed over N training images equal
a closed-form computation over the same images, and are the same for 1, 2 and 3 ranks."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from helpers import EVAL_TINY, REPO, TEST, TINY_TRAIN, assert_ok, in_process, on_ranks, read_metrics
from models import TinyNet
from torch import nn

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import ConfigError, get_cfg_defaults, validate_cfg
from distribuuuu.data.loader import precise_bn_indices
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.evaluation import precise_bn
from distribuuuu.training.inputs import build_precise_bn_split
from distribuuuu.training.precise_bn import bn_layers, bn_moment_sums, recompute_bn_stats, set_bn_stats

DIGITS = str(REPO / "data" / "digits")


def tiny_model() -> nn.Module:
    """The tiny CNN (two conv-BN blocks) with non-trivial BN affine weights, so the second BN's
    input depends on the first's normalisation."""
    torch.manual_seed(0)
    model = TinyNet(10)
    for m in bn_layers(model):
        nn.init.uniform_(m.weight, 0.5, 2.0)
        nn.init.uniform_(m.bias, -1.0, 1.0)
    return model


def cfg(images: int, transform: str = "train"):
    """Digits at 16 px, batches of 4, ``images`` precise-BN images read with ``transform``."""
    c = get_cfg_defaults()
    c.merge_from_list(["MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"])
    c.merge_from_list(["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "TRAIN.BATCH_SIZE", "4", "TRAIN.WORKERS", "0"])
    c.merge_from_list(["BN.PRECISE_IMAGES", str(images), "BN.PRECISE_TRANSFORM", transform])
    validate_cfg(c)
    return c


def _stats(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.running_mean.clone(), m.running_var.clone()) for m in bn_layers(model)]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def test_one_batch_equals_torchs_cumulative_batchnorm_over_the_same_images():
    # Independent: torch's own BatchNorm, momentum None (a cumulative average), reset, fed all N
    # images as one batch, stores the batch mean and the unbiased batch variance.
    model, images = tiny_model(), torch.randn(12, 3, 16, 16)
    reference = copy.deepcopy(model).train()
    for m in bn_layers(reference):
        m.reset_running_stats()
        m.momentum = None
    with torch.no_grad():
        reference(images)
    tracked = [m.num_batches_tracked.clone() for m in bn_layers(model)]
    assert recompute_bn_stats(model, [images], reduce=_identity) == 12
    # float32 moments of 12 x 16 x 16 values per channel, taken two ways: a few float32 ulps apart.
    for (mean, var), (ref_mean, ref_var) in zip(_stats(model), _stats(reference)):
        torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, ref_var, rtol=1e-5, atol=1e-6)
    assert [m.num_batches_tracked for m in bn_layers(model)] == tracked  # not a training step
    assert all(m.training for m in model.modules())  # every module left in the mode it had


def test_fixed_batches_give_the_moments_of_every_input_each_bn_layer_saw():
    # Batches of 4, 4 and 2: each BN layer's inputs (BN normalising with batch statistics, as in
    # training) captured and concatenated, then their mean and unbiased variance in float64.
    model = tiny_model()
    batches = list(torch.randn(10, 3, 16, 16).split(4))
    probe = copy.deepcopy(model).eval()
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(bn_layers(probe)))}
    for i, m in enumerate(bn_layers(probe)):
        m.train()
        m.register_forward_pre_hook(lambda mod, inp, i=i: seen[i].append(inp[0].detach().clone()))
    with torch.no_grad():
        for x in batches:
            probe(x)
    recompute_bn_stats(model, batches, reduce=_identity)
    for i, (mean, var) in enumerate(_stats(model)):
        values = torch.cat(seen[i]).double().transpose(0, 1).flatten(1)  # (C, all values)
        ref_var, ref_mean = torch.var_mean(values, dim=1, correction=1)
        # The sums are float64; running stats are float32: one float32 rounding of the same number.
        torch.testing.assert_close(mean, ref_mean.float(), rtol=2**-22, atol=1e-7)
        torch.testing.assert_close(var, ref_var.float(), rtol=2**-20, atol=1e-7)


@pytest.mark.parametrize("transform", ["train", "val"])
def test_statistics_are_identical_for_world_size_1_2_3(transform):
    # Each rank's part computed in this process from its own loader and summed, as the all-reduce
    # sums them: 22 images in batches of 4 (the last of 2), dealt to 1, 2 and 3 ranks.
    config, model = cfg(22, transform), tiny_model()
    results, indices = {}, precise_bn_indices(1436, 22, config.RNG_SEED)
    for world in (1, 2, 3):
        totals, seen = None, []
        for rank in range(world):
            split = build_precise_bn_split(config, DistEnv(rank=rank, world_size=world))
            seen += [i for batch in split.sampler for i in batch]
            sums = bn_moment_sums(model, (images for images, _, _ in split.loader))
            totals = sums if totals is None else totals + sums
        assert sorted(seen) == sorted(indices) and len(seen) == 22  # the same images, each on one rank
        results[world] = copy.deepcopy(model)
        set_bn_stats(results[world], totals)
    for world in (2, 3):
        # The same batches on any world size; only the float64 sums meet in another order (about
        # 2**-52 relative), far below the float32 rounding of the result: equal bit for bit.
        for (mean, var), (mean1, var1) in zip(_stats(results[world]), _stats(results[1])):
            assert torch.equal(mean, mean1) and torch.equal(var, var1)
    # The collective path on one process gives the same as the bookkeeping above.
    one = copy.deepcopy(model)
    assert recompute_bn_stats(one, (x for x, _, _ in build_precise_bn_split(config, DistEnv()).loader)) == 22
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(_stats(one), _stats(results[1])))


def test_bad_precise_bn_keys_are_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="BN.PRECISE_TRANSFORM"):
        cfg(8, "test")
    syncbn = get_cfg_defaults()
    syncbn.merge_from_list(["BN.PRECISE_IMAGES", "8", "MODEL.SYNCBN", "True"])
    with pytest.raises(ConfigError, match="BN.PRECISE_IMAGES cannot combine with MODEL.SYNCBN"):
        validate_cfg(syncbn)
    with pytest.raises(ConfigError, match=r"BN.PRECISE_IMAGES \(5000\) exceeds the 1436 images"):
        build_precise_bn_split(cfg(5000), DistEnv())


def test_training_recomputes_raw_and_ema_statistics_and_test_net_reproduces_them(tmp_path):
    # One epoch with EMA and precise BN: both weights' statistics recomputed before evaluation and
    # saved. test_net.py does it only when asked (BN. is not taken from the checkpoint); asked, it
    # recomputes the same statistics over the same images.
    out, data = tmp_path / "run", ["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]
    opts = [*EVAL_TINY, "OPTIM.MAX_EPOCH", "1", "OPTIM.EMA_DECAY", "0.9", "TRAIN.BATCH_SIZE", "32"]
    result = in_process(TINY_TRAIN, "OUT_DIR", str(out), *data, *opts, "BN.PRECISE_IMAGES", "200")
    assert_ok(result)
    log = (out / "log.txt").read_text()
    assert "precise BN (model weights): BatchNorm statistics recomputed over 200 training images" in log
    assert "precise BN (ema weights)" in log
    [val] = [r for r in read_metrics(out) if r["split"] == "val" and r["weights"] == "model"]
    weights = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1))
    plain = in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", str(tmp_path / "plain"))
    assert_ok(plain)
    assert "precise BN" not in (tmp_path / "plain" / "log.txt").read_text()  # not taken from the checkpoint
    asked = in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", str(tmp_path / "bn"), "BN.PRECISE_IMAGES", "200")
    assert_ok(asked)
    assert "precise BN (model weights)" in (tmp_path / "bn" / "log.txt").read_text()
    # The checkpoint holds the recomputed statistics (saved after the evaluation that used them),
    # and recomputing them again in test_net.py gives the same: both score what the run scored.
    for folder in ("plain", "bn"):
        [test] = [r for r in read_metrics(tmp_path / folder) if r["split"] == "test"]
        assert test["top1"] == val["top1"] and test["loss"] == pytest.approx(val["loss"], rel=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_all_reduce_to_the_one_process_statistics(world):
    # The trainer's path (validation.precise_bn) on every rank of a threaded process group: each
    # rank its own fixed batches of the 22 images, one float64 all-reduce; every rank then holds
    # the statistics one process computes over all 22 (the same batches, so equal bit for bit).
    config, model = cfg(22), tiny_model()
    recompute_bn_stats(model, (x for x, _, _ in build_precise_bn_split(config, DistEnv()).loader))
    start = tiny_model()  # built before the threads: torch's global RNG is the process's
    # The train transform seeds that global RNG per sample (SeededTransformDataset): rank threads
    # reading at once would draw from each other's seeds, so each rank reads its batches in turn.
    reading = threading.Lock()

    def rank_job(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine, env = copy.deepcopy(start), DistEnv(rank=rank, world_size=world)
        split = build_precise_bn_split(config, env)
        with reading:
            split = dataclasses.replace(split, loader=list(split.loader))
        precise_bn({"model": mine}, split, config, env)
        return _stats(mine)

    for stats in on_ranks(world, rank_job):
        assert all(torch.equal(m, m1) and torch.equal(v, v1) for (m, v), (m1, v1) in zip(stats, _stats(model)))
