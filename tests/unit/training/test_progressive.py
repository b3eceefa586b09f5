"""Progressive resizing (TRAIN.PROGRESSIVE_*): FFCV's schedule, the size reaching persistent workers and
the batched decoder, a resume in the middle of the ramp (on another world size: the data; on the
same: the trained weights, bit for bit), and one static graph per size under TRAIN.COMPILE.

The data tests build every rank's loader in this process; the trainer's resume is two single-process
runs of tests/models.py's tiny CNN on the digits at 8 -> 12 -> 16 px.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, TINY_TRAIN, assert_ok, in_process, read_metrics

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import load_cfg
from distribuuuu.data.datasets import sample_seed, seeded_cpu_rng
from distribuuuu.data.pack import PackOptions, pack_split
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training import parallelize
from distribuuuu.training import run as run_setup
from distribuuuu.training.inputs import build_train_split
from distribuuuu.training.preprocessing import build_normalize, build_train_transform, progressive

DIGITS = str(REPO / "data" / "digits")
# Epochs 0, 1, 2 (from 0) train at 8, 12 and 16 px.
RAMP = [
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "3", "TRAIN.PROGRESSIVE_START_SIZE", "8",
    "TRAIN.PROGRESSIVE_SIZE_MULTIPLE", "4", "TRAIN.PROGRESSIVE_END_EPOCH", "2",
    "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS,
]  # fmt: skip
SIZES = [8, 12, 16]


def ffcv_get_resolution(epoch: int, min_res: int, max_res: int, end_ramp: int, start_ramp: int) -> int:
    """ffcv-imagenet's train_imagenet.py ``get_resolution``, verbatim but for its fixed multiple 32."""
    assert end_ramp > start_ramp, "end_ramp must be greater than start_ramp"
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


def _ramp(start_size: int, end_size: int, start_epoch: int, end_epoch: int, epochs: int, multiple: int = 32):
    return load_cfg(None, [
        "TRAIN.IM_SIZE", str(end_size), "TEST.IM_SIZE", str(end_size), "OPTIM.MAX_EPOCH", str(epochs),
        "TRAIN.PROGRESSIVE_START_SIZE", str(start_size), "TRAIN.PROGRESSIVE_START_EPOCH", str(start_epoch),
        "TRAIN.PROGRESSIVE_END_EPOCH", str(end_epoch), "TRAIN.PROGRESSIVE_SIZE_MULTIPLE", str(multiple),
    ])  # fmt: skip


@pytest.mark.parametrize(
    "start_size, end_size, start_epoch, end_epoch, epochs",
    [(160, 192, 65, 76, 88), (160, 224, 10, 30, 40), (64, 256, 0, 7, 9), (96, 128, 3, 4, 6), (128, 128, 1, 5, 8)],
)
def test_the_size_of_each_epoch_is_ffcvs_get_resolution(start_size, end_size, start_epoch, end_epoch, epochs):
    cfg = _ramp(start_size, end_size, start_epoch, end_epoch, epochs)
    expected = [ffcv_get_resolution(e, start_size, end_size, end_epoch, start_epoch) for e in range(epochs)]
    assert [progressive(cfg).size_at(e) for e in range(epochs)] == expected
    assert progressive(cfg).sizes() == list(dict.fromkeys(expected))


def test_ffcvs_resnet50_ramp_switches_where_the_line_crosses_the_midpoint_of_the_two_sizes():
    """160 -> 192 over epochs 65-76: 160 + 32 (e - 65) / 11 reaches 176, halfway, at e = 70.5."""
    cfg = _ramp(160, 192, 65, 76, 88)
    assert [progressive(cfg).size_at(e) for e in range(88)] == [160] * 71 + [192] * 17
    off = load_cfg(None, ["TRAIN.IM_SIZE", "48", "TEST.IM_SIZE", "48"])
    assert {progressive(off).size_at(e) for e in range(20)} == {48}


@pytest.mark.usefixtures("plain_logging")
def test_the_run_logs_its_sizes_by_epoch_and_warns_when_it_ends_inside_the_ramp(caplog):
    assert progressive(load_cfg(None, RAMP)).text() == "8 px: epoch 1; 12 px: epoch 2; 16 px: epoch 3"
    assert progressive(_ramp(160, 192, 65, 76, 88)).text() == "160 px: epochs 1-71; 192 px: epochs 72-88"
    # A run shorter than the ramp is valid (test_net.py reads these keys from a checkpoint, and not
    # OPTIM.MAX_EPOCH), and says where it ends.
    with caplog.at_level("WARNING", logger="distribuuuu"):
        run_setup.log_progressive_schedule(_ramp(160, 192, 65, 76, 70))
    assert "the last epoch trains at 160 px, not TRAIN.IM_SIZE 192" in caplog.text


def _split(world: int = 1, rank: int = 0, *opts: str):
    cfg = load_cfg(None, [*RAMP, "TRAIN.BATCH_SIZE", "8", *opts])
    return cfg, build_train_split(cfg, DistEnv(rank=rank, world_size=world))


def _expected_images(cfg, split, epoch: int, keys: list[tuple[int, int]]) -> torch.Tensor:
    """Each sample's crop at the epoch's size, drawn from its key's seed: built here from the base images."""
    transform = build_train_transform(cfg, normalize=False, size=SIZES[epoch])
    images = []
    for round_, index in keys:
        with seeded_cpu_rng(sample_seed(cfg.RNG_SEED, round_, index)):
            images.append(transform(split.dataset.base[index][0]))
    return build_normalize(cfg)(torch.stack(images))


@pytest.mark.parametrize(
    "decoder, sampler, batched_augment",
    [
        ("auto", "default", False), ("batched", "default", True), ("batched", "default", False),
        ("auto", "repeated", False), ("batched", "weighted", True), ("batched", "repeated", False),
    ],
)  # fmt: skip
def test_persistent_workers_and_the_batched_decoder_crop_each_epoch_at_its_size(decoder, sampler, batched_augment):
    """One persistent worker, made once before epoch 0, crops every epoch at that epoch's size; the
    batched decoder does too: each batch equals the crops computed here. With DATA.BATCHED_AUGMENT
    the worker draws the crop at the key's epoch's size and this process resamples the batch to
    the size of its plans (on a CPU, aten's per-image kernel: today's pixels exactly); without, the
    per-sample transform runs in this process, told the epoch by the loader. The repeated and
    weighted samplers' keys count augmentation rounds, several an epoch."""
    opts = ["TRAIN.WORKERS", "1", "TRAIN.PERSISTENT_WORKERS", "True", "DATA.DECODER", decoder, "TRAIN.SAMPLER", sampler]
    opts += ["DATA.BATCHED_AUGMENT", str(batched_augment)]
    cfg, split = _split(1, 0, *opts)
    for epoch in (0, 1, 2, 1):  # back to 1: a size is the epoch's, not the last one's
        split.sampler.set_epoch(epoch)
        keys = list(split.sampler)[:8]
        images, _, _ = next(iter(split.loader))
        assert images.shape == (8, 3, SIZES[epoch], SIZES[epoch])
        assert torch.equal(images, _expected_images(cfg, split, epoch, keys))


def _steps(world: int, epoch: int, position: int, steps: int, *opts: str) -> list[torch.Tensor]:
    """The images W ranks train on in ``steps`` steps from global ``position``, in global order."""
    per_rank = []
    for rank in range(world):
        _, split = _split(world, rank, *opts)
        split.sampler.set_epoch(epoch)
        split.sampler.set_position(position)  # what start_epoch_sampler does with the checkpoint's position
        batches = iter(split.loader)
        per_rank.append([next(batches)[0] for _ in range(steps)])
    # Step s of rank r holds global positions position + (s * batch + j) * W + r.
    return [per_rank[r][s][j] for s in range(steps) for j in range(8) for r in range(world)]


@pytest.mark.parametrize("data", ["imagefolder", "packed shards, windowed order"])
def test_an_epoch_of_the_ramp_resumed_on_3_ranks_after_2_reads_the_images_of_one_uninterrupted_rank(
    data, tmp_path, monkeypatch
):
    opts = []
    if data != "imagefolder":  # 5 shards of 300 read 2 at a time (DATA.SHUFFLE_WINDOW)
        pytest.importorskip("webdataset")  # the "data" extra: webdataset writes the shards, wids reads them
        pytest.importorskip("wids")
        monkeypatch.setattr("distribuuuu.data.packed.default_cache_dir", lambda root: str(tmp_path / "links"))
        pack_split(DIGITS, "train", str(tmp_path / "packed"), PackOptions(shard_size=300))
        opts = ["TRAIN.DATASET", str(tmp_path / "packed"), "DATA.SHUFFLE_WINDOW", "2"]
    epoch = 1  # the middle of the ramp: 12 px
    before = _steps(2, epoch, 0, 3, *opts)  # 48 samples
    after = _steps(3, epoch, len(before), 2, *opts)  # 48 more, from where the 2 ranks stopped
    uninterrupted = _steps(1, epoch, 0, 12, *opts)
    assert all(image.shape == (3, 12, 12) for image in before + after)
    assert torch.equal(torch.stack(before + after), torch.stack(uninterrupted))


# ------------------------------------------------------------------------------------------------
# The trainer: the size in the records, and a mid-epoch resume in the ramp to the same weights
# ------------------------------------------------------------------------------------------------
STEPS = 1436 // 32  # optimizer steps per epoch on one process
TRAIN_RUN = [
    "MODEL.ARCH", "tiny_cnn", *RAMP, "TRAIN.WORKERS", "1", "TRAIN.CKPT_PERIOD_ITERS", "20", "TRAIN.KEEP_CKPTS", "20",
    "TRAIN.PRINT_FREQ", "10", "DATA.MIXUP_ALPHA", "0.2", "OPTIM.EMA_DECAY", "0.9",
]  # fmt: skip


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_in_the_ramp_trains_the_weights_of_the_uninterrupted_run(tmp_path):
    """Epoch 2 (12 px) resumed from its step-20 checkpoint by a new run (the tool's __main__ again,
    in this process), its persistent worker started at that epoch: weights, EMA and momentum
    bit-identical to the uninterrupted run's."""
    reference = tmp_path / "reference"
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(reference), *TRAIN_RUN))
    train = [r for r in read_metrics(reference) if r["split"] == "train"]
    assert [(r["epoch"], r["im_size"]) for r in train] == [(1, 8), (2, 12), (3, 16)]
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    mid_ramp = ckpt.checkpoint_name(2, 20)
    saved = ckpt.list_checkpoints(str(resumed / ckpt.CKPT_DIR))  # oldest first
    for path in saved[[Path(p).name for p in saved].index(mid_ramp) + 1 :]:  # as if stopped right after it
        Path(path).unlink()
    result = in_process(TINY_TRAIN, "OUT_DIR", str(resumed), *TRAIN_RUN)
    assert_ok(result)
    assert f"resumed from {resumed / ckpt.CKPT_DIR / mid_ramp} at epoch 2, step 20" in result.stdout
    assert "epoch 2/3 trains at 12 px" in result.stdout and "epoch 3/3 trains at 16 px" in result.stdout
    final = [ckpt.load_checkpoint(str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(3))) for out in (reference, resumed)]
    for name in ("model", "ema", "optimizer"):
        a, b = final[0][name], final[1][name]
        a, b = (a["module"], b["module"]) if name == "ema" else (a, b)
        if name == "optimizer":
            a, b = ({k: v["momentum_buffer"] for k, v in x["state"].items()} for x in (a, b))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"{name} differs from the uninterrupted run"


# ------------------------------------------------------------------------------------------------
# TRAIN.COMPILE: one static graph per size
# ------------------------------------------------------------------------------------------------
def _graphs_for_sizes(cfg, sizes: list[int], monkeypatch) -> int:
    """How many graphs dynamo compiled for the training forward at ``sizes`` (the eager backend:
    guards, recompiles and the recompile limit are dynamo's own, whatever the backend)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.AdaptiveAvgPool2d(1))
    compiled = parallelize.wrap_model(model, cfg, DistEnv())
    for size in sizes:
        compiled(torch.randn(2, 3, size, size)).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_compile_under_progressive_resizing_makes_one_static_graph_per_size_past_dynamos_default_limit(monkeypatch):
    cfg = load_cfg(None, ["TRAIN.COMPILE", "True"])
    ramp = _ramp(8, 80, 0, 9, 10, multiple=8)  # 10 sizes: more than dynamo's default 8 graphs per function
    ramp.defrost()
    ramp.TRAIN.COMPILE = True
    sizes = progressive(ramp).sizes()
    assert sizes == list(range(8, 81, 8))
    assert _graphs_for_sizes(ramp, sizes, monkeypatch) == len(sizes)
    # Without the ramp torch's default applies: the second size recompiles with a symbolic height
    # and width, and that graph serves every later size (what the ramp's end size would run).
    assert _graphs_for_sizes(cfg, sizes[:4], monkeypatch) == 2
