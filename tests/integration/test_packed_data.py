"""Packed datasets (tools/pack_dataset.py + data/packed.py) against the ImageFolder they were packed from.

The digits are packed once per module by the pack tool itself (5 train shards of 300, 2 val
shards), in ImageFolder's order (``--no-shuffle``) for the checks index by index, and with the
tool's default shuffle across shards for the checks by name (the block at the end). Every check
compares the packed path with an independent computation on the ImageFolder: its samples and
pixels, the sampler's order, evaluation results, training metrics and weights.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    EVAL_TINY,
    REPO,
    TINY_TRAIN,
    _without_timings,
    assert_ok,
    clean_env,
    in_process,
    python,
    read_metrics,
    run,
    serve_folder,
)
from sampler_helpers import RESUME_AT, config_sampler_keys, window_stretches
from torch import nn

from distribuuuu.config import get_cfg_defaults
from distribuuuu.data import DataError, remote
from distribuuuu.data.datasets import CheckedImageFolder, SeededTransformDataset
from distribuuuu.data.pack import PackOptions, pack_split
from distribuuuu.data.packed import BadShardError, PackedDataset, key_of
from distribuuuu.data.readers import build_base_dataset
from distribuuuu.data.samplers import ResumableDistributedSampler, ShardWindowSampler
from distribuuuu.runtime.launcher import DistEnv, find_free_port
from distribuuuu.training.inputs import build_train_split, build_val_split
from distribuuuu.training.preprocessing import build_normalize

pytest.importorskip("wids")
DIGITS = REPO / "data" / "digits"
PACK = str(REPO / "tools" / "pack_dataset.py")
SHARD_SIZE = 300
TINY = [*EVAL_TINY, "TRAIN.PRINT_FREQ", "5"]


@pytest.fixture(autouse=True)
def shard_cache_in_tmp(tmp_path, monkeypatch):
    """Readers built in this process keep their shard links under the test's tmp_path, not in /tmp."""
    monkeypatch.setattr("distribuuuu.data.packed.default_cache_dir", lambda root: str(tmp_path / "shard-cache"))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "digits"
    result = in_process(PACK, str(DIGITS), str(out), "--shard-size", str(SHARD_SIZE), "--no-shuffle")
    assert_ok(result)
    assert "train: 1436 samples in 5 shards (5 written, 0 kept)" in result.stdout
    return out


@pytest.fixture(scope="module")
def http_url(packed):
    """``packed`` served by a real HTTP server on 127.0.0.1 (a thread of this process, shut down after)."""
    with serve_folder(packed) as url:
        yield url


def _pixels(image) -> torch.Tensor:
    import numpy as np

    return torch.as_tensor(np.array(image))


def test_packed_split_holds_the_imagefolder_samples_pixels_and_classes(packed):
    for split in ("train", "val"):
        folder = CheckedImageFolder(str(DIGITS / split), "pil")
        pk = PackedDataset(str(packed), split, "pil")
        assert pk.classes == folder.classes and pk.targets == folder.targets
        assert [name for name, _ in pk.samples] == [os.path.relpath(p, DIGITS / split) for p, _ in folder.samples]
        for i in range(len(folder)):
            (a, ta), (b, tb) = pk[i], folder[i]
            assert ta == tb and torch.equal(_pixels(a), _pixels(b)), f"{split} sample {i} differs"


def test_pack_interrupted_half_way_and_run_again_writes_the_same_shards(packed, tmp_path):
    _assert_interrupted_pack_resumes_to(packed, PackOptions(shard_size=SHARD_SIZE, shuffle_seed=None), tmp_path)


def _assert_interrupted_pack_resumes_to(reference: Path, opts: PackOptions, tmp_path: Path) -> None:
    """Stopped after 2 of 5 train shards (plus a stray half-written .part) and run again: the 2 are
    kept, 3 written, and every file equals ``reference``'s (an uninterrupted pack with ``opts``)."""

    def interrupt_after_two(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_split(str(DIGITS), "train", str(tmp_path), opts, interrupt_after_two)
    assert not (tmp_path / "train" / "index.json").exists(), "the index is written last"
    # What a killed run leaves: half-written shards and records under temporary names.
    (tmp_path / "train" / "shard-000002.tar.part").write_bytes(b"half a shard from a killed run")
    (tmp_path / "train" / ".shard-000003.tar.k1ll3d.part").write_bytes(b"half a shard from a killed run")
    (tmp_path / "train" / ".parts" / ".000003.json.k1ll3d.part").write_text('{"fingerprint": ')
    again = pack_split(str(DIGITS), "train", str(tmp_path), opts)
    assert (again.shards, again.written) == (5, 3), "the two finished shards are kept, the rest written"
    names = sorted(p.name for p in (reference / "train").iterdir() if p.is_file())
    assert names == sorted(p.name for p in (tmp_path / "train").iterdir() if p.is_file())
    for name in names:
        assert (tmp_path / "train" / name).read_bytes() == (reference / "train" / name).read_bytes(), name
    assert not list((tmp_path / "train").rglob("*.part")), "the killed run's temporary files are gone"
    assert pack_split(str(DIGITS), "train", str(tmp_path), opts).written == 0, "a finished pack is kept"


def _shard_of_rows(packed: Path, split: str = "train") -> list[int]:
    """Each row's shard, read from the index's shard list (not from the reader)."""
    index = json.loads((packed / split / "index.json").read_text())
    return [k for k, shard in enumerate(index["shardlist"]) for _ in range(shard["nsamples"])]


def _interleave(keys: list[list]) -> list:
    """Global position p is rank p % W's (p // W)-th key: interleaving the ranks gives the epoch's order."""
    world = len(keys)
    return [keys[p % world][p // world] for p in range(sum(map(len, keys)))]


@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_training_sample_once_per_epoch_in_an_order_independent_of_world_size(packed, world, window):
    """Window 0: torch.randperm of (seed, epoch), DistributedSampler's. DATA.SHUFFLE_WINDOW 2: the
    one-process order, made of windows of 2 of the index's shards."""
    pk = PackedDataset(str(packed), "train")
    folder = CheckedImageFolder(str(DIGITS / "train"))
    n, epoch = len(pk), 3
    keys = []
    for rank in range(world):
        if window:
            sampler = ShardWindowSampler(pk, world, rank, 7, pk.sample_shards(), window)
        else:
            sampler = ResumableDistributedSampler(pk, world, rank, seed=7)
        sampler.set_epoch(epoch)
        keys.append(list(sampler))
    order = [index for _, index in _interleave(keys)]
    if window:
        one_process = ShardWindowSampler(pk, 1, 0, 7, _shard_of_rows(packed), window)
        one_process.set_epoch(epoch)
        expected = [index for _, index in one_process]
        assert len(window_stretches(expected, _shard_of_rows(packed), window)) == 3  # 5 shards: 2 + 2 + 1
    else:
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
    assert order[:n] == expected and order[n:] == expected[: len(order) - n], "one permutation, any world size"
    counts = Counter(order[:n])
    assert len(counts) == n and set(counts.values()) == {1}, "each sample exactly once per epoch"
    assert all(e == epoch for ks in keys for e, _ in ks)
    for index in order[:n:7]:  # what the shards hold at those rows is the ImageFolder's sample
        _, name, target = pk.encoded(index)
        path, folder_target = folder.samples[index]
        assert name.startswith(f"{os.path.relpath(path, DIGITS / 'train')} from ") and target == folder_target


BATCH = 32


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_window_loaders_train_on_each_sample_once_in_windows_whatever_the_ranks_and_workers(
    packed, world, workers
):
    """build_train_split with DATA.SHUFFLE_WINDOW 2 on 1-3 ranks with 0 or 2 workers: the loaders
    hand over the sampler's samples in its order (targets and pixels of the first 4 batches), and
    the ranks' samplers interleave into one order, the same for every world size, made of windows
    of 2 shards, each sample once; resumed at a global position that another world size reached,
    the ranks continue that same order."""
    cfg = get_cfg_defaults()
    cfg.TRAIN.DATASET, cfg.DATA.SHUFFLE_WINDOW, cfg.TRAIN.WORKERS = str(packed), 2, workers
    cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE, cfg.RNG_SEED = 16, BATCH, 5
    normalize, keys, resumed = build_normalize(cfg), [], []
    for rank in range(world):
        split = build_train_split(cfg, DistEnv(rank=rank, world_size=world))
        split.sampler.set_epoch(2)
        keys.append(list(split.sampler))
        assert len(split.loader) == len(keys[-1]) // BATCH, "drop_last: full batches only"
        for b, (images, targets, _) in zip(range(4), split.loader):  # with 2 workers, each worker's first two
            batch_keys = keys[-1][b * BATCH : (b + 1) * BATCH]
            assert targets.tolist() == [split.dataset.base.targets[i] for _, i in batch_keys]
            expected = torch.stack([split.dataset[k][0] for k in batch_keys])
            assert torch.equal(images, normalize(expected)), f"rank {rank} batch {b}"
        split.sampler.set_position(6 * BATCH)  # 3 steps of 2 ranks, or 6 of 1, or 2 of 3
        resumed.append(list(split.sampler))
    n = len(split.dataset)
    order = [index for _, index in _interleave(keys)]
    window_stretches(order[:n], _shard_of_rows(packed), 2)
    one_process = ShardWindowSampler(range(n), 1, 0, 5, _shard_of_rows(packed), 2)
    one_process.set_epoch(2)
    assert order[:n] == [index for _, index in one_process]
    assert [index for _, index in _interleave(resumed)][: n - 6 * BATCH] == order[6 * BATCH : n]


def test_shard_window_order_of_2_ranks_of_a_real_config_is_the_one_process_order_and_resumes(packed, tmp_path):
    """Both ranks' samplers of a real config (load_cfg, build_train_split) with DATA.SHUFFLE_WINDOW
    2: their keys interleave into the order one process computes for each epoch, windows of 2
    shards, and an epoch resumed after 5 samples a rank continues it exactly."""
    opts = ["TRAIN.DATASET", str(packed), "DATA.SHUFFLE_WINDOW", "2", "DATA.SHARD_CACHE", str(tmp_path / "cache")]
    ranks = config_sampler_keys(opts, 2)
    shard_of = _shard_of_rows(packed)
    for epoch in (0, 1):
        keys = _interleave([rank[epoch] for rank in ranks])
        one_process = ShardWindowSampler(range(len(shard_of)), 1, 0, get_cfg_defaults().RNG_SEED, shard_of, 2)
        one_process.set_epoch(epoch)
        assert keys == list(one_process)  # 1436 samples: no padding on 2 ranks
        window_stretches([index for _, index in keys], shard_of, 2)
    for rank in ranks:
        assert rank["resumed"] == rank[1][RESUME_AT:]


def test_packed_jpegs_take_the_decoders_and_the_batched_path_of_the_folder(tmp_path):
    """JPEGs keep their format through packing: "auto" decodes them with torchvision.io, "pil" with
    PIL, and the batched decoder gets their bytes, as from the files."""
    from PIL import Image
    from torchvision import tv_tensors

    from distribuuuu.data.batched import EncodedImageDataset

    for i in range(4):
        (tmp_path / "src" / "train" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (20 + i, 16), (40 * i, 90, 200)).save(tmp_path / "src" / "train" / f"c{i % 2}" / f"{i}.jpg")
    pack_split(str(tmp_path / "src"), "train", str(tmp_path / "packed"), PackOptions(shard_size=3, shuffle_seed=None))
    folder = CheckedImageFolder(str(tmp_path / "src" / "train"))
    pk = PackedDataset(str(tmp_path / "packed"), "train")
    encoded = EncodedImageDataset(pk, seed=0)
    for i, (path, _) in enumerate(folder.samples):
        assert isinstance(pk[i][0], tv_tensors.Image) and torch.equal(pk[i][0], folder[i][0])
        sample = encoded[(0, i)]
        assert sample.encoded and sample.data.numpy().tobytes() == Path(path).read_bytes()
    assert not isinstance(PackedDataset(str(tmp_path / "packed"), "train", "pil")[0][0], torch.Tensor)


def _eval_predictions(cfg, world: int) -> dict[int, tuple[int, int]]:
    """{sample index: (prediction, target)} of a seeded tiny model over every rank of ``world``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 10)).eval()
    seen: dict[int, tuple[int, int]] = {}
    for rank in range(world):
        split = build_val_split(cfg, DistEnv(rank=rank, world_size=world))
        indices = iter(split.sampler)
        with torch.no_grad():
            for images, targets, _ in split.loader:
                for pred, target in zip(model(images).argmax(1).tolist(), targets.tolist()):
                    index = next(indices)
                    assert index not in seen, f"sample {index} evaluated twice"
                    seen[index] = (pred, target)
    return seen


def test_exact_eval_is_the_imagefolders_for_world_size_1_2_3(packed):
    cfg = get_cfg_defaults()
    cfg.TEST.IM_SIZE, cfg.TRAIN.IM_SIZE, cfg.TEST.BATCH_SIZE, cfg.TRAIN.WORKERS = 16, 16, 50, 0
    reference = _eval_predictions(cfg, 1)  # the ImageFolder data/digits/val
    assert len(reference) == 361
    cfg.TEST.DATASET = str(packed)
    for world in (1, 2, 3):
        assert _eval_predictions(cfg, world) == reference, f"world size {world}"


def test_a_global_random_order_opens_each_shard_once(packed):
    """The default order reads any shard at any step: each reader keeps every shard open (5 here),
    where wids' 4 open shards reopened one, re-scanning its tar, at most reads (docs/gpu.md)."""
    dataset = PackedDataset(str(packed), "train")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    for i in order:
        name = dataset.samples[i][0]
        dataset.read_row(dataset.samples.row(i), name)
    assert dataset.shards.get_stats() == (len(dataset), 5)  # (accesses, misses): one open a shard


@pytest.mark.parametrize(
    "shards,soft,hard,raised,kept",
    [
        (5000, 1024, 4096, 4096, 4096 - 256),  # as many as the hard limit lets the process open
        (2000, 1024, -1, 2256, 2000),  # no hard limit (RLIM_INFINITY): room for every shard
        (100, 1 << 20, 1 << 20, None, 100),  # enough already: the limit is left alone
        (100, 260, 260, None, 4),  # no room at all: the few of a windowed order still
    ],
)
def test_open_shards_raise_the_file_limit_up_to_the_hard_one(monkeypatch, shards, soft, hard, raised, kept):
    import resource

    from distribuuuu.data.packed import open_shards_limit

    hard = resource.RLIM_INFINITY if hard == -1 else hard
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append((which, limits)))
    assert open_shards_limit(shards) == kept
    assert calls == ([(resource.RLIMIT_NOFILE, (raised, hard))] if raised else [])


def _truncated_copy(packed: Path, tmp_path: Path, shard: str) -> Path:
    copy = tmp_path / "digits"
    shutil.copytree(packed, copy)
    path = copy / "train" / shard
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return copy


def test_truncated_shard_is_named_or_skipped(packed, tmp_path):
    copy = _truncated_copy(packed, tmp_path, "shard-000002.tar")
    pk = PackedDataset(str(copy), "train")
    pk[0]  # shard 0 is intact
    with pytest.raises(BadShardError, match=r"shard .*shard-000002\.tar is \d+ bytes, the index says \d+ \(truncated"):
        pk[2 * SHARD_SIZE + 5]
    assert SeededTransformDataset(pk, None, seed=0, skip_bad=True)[(0, 2 * SHARD_SIZE)] is None


def test_dead_url_is_one_error_naming_the_index(monkeypatch):
    monkeypatch.setattr(remote, "RETRY", remote.Retry(backoff_s=0.001, max_backoff_s=0.01))  # every attempt, no wait
    url = f"http://127.0.0.1:{find_free_port()}/digits"
    with pytest.raises(DataError, match=f"cannot read {url}/train/index.json"):
        build_base_dataset(url, "train")


def test_training_on_a_truncated_shard_stops_naming_it_or_skips_and_counts_its_samples(packed, tmp_path):
    copy = _truncated_copy(packed, tmp_path, "shard-000002.tar")
    args = ["TRAIN.DATASET", str(copy), "TEST.DATASET", str(copy), *TINY, "OPTIM.MAX_EPOCH", "1", "TRAIN.WORKERS", "1"]
    args += ["DATA.SHARD_CACHE", str(tmp_path / "cache")]
    failed = in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path / "error"), *args)
    assert failed.returncode == 1, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and "shard-000002.tar" in errors[0] and "truncated" in errors[0], failed.stderr[-3000:]

    skipped = in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path / "skip"), *args, "DATA.BAD_IMAGE", "skip")
    assert_ok(skipped)
    # The samples of shard 2 (rows 600..899) among the epoch's 44 full batches of 32.
    sampler = ResumableDistributedSampler(range(1436), 1, 0, seed=get_cfg_defaults().RNG_SEED)
    sampler.set_epoch(0)
    drawn = [i for _, i in list(sampler)[: 1436 // 32 * 32]]
    expected = sum(2 * SHARD_SIZE <= i < 3 * SHARD_SIZE for i in drawn)
    train = [r for r in read_metrics(tmp_path / "skip") if r["split"] == "train"]
    assert [(r["skipped_images"], r["samples"]) for r in train] == [(expected, len(drawn) - expected)]


@pytest.mark.slow
def test_mid_epoch_resume_from_packed_data_is_bit_identical(packed, tmp_path):
    from fault_helpers import STEPS_ONE, _assert_same_weights, _final_state

    common = [*TINY, "OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_ITERS", "10", "TRAIN.WORKERS", "2"]
    common += ["DATA.MIXUP_ALPHA", "0.2", "OPTIM.EMA_DECAY", "0.9"]  # global RNG and EMA state: both must resume
    common += ["DATA.SHARD_CACHE", str(tmp_path / "cache")]
    on = {"folder": ["TRAIN.DATASET", str(DIGITS), "TEST.DATASET", str(DIGITS)]}
    on["packed"] = ["TRAIN.DATASET", str(packed), "TEST.DATASET", str(packed)]
    for name, data in on.items():  # in this process, one after the other
        assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path / name), *common, *data))
    reference = _final_state(tmp_path / "packed")
    _assert_same_weights(reference, _final_state(tmp_path / "folder"))  # the same pixels, the same run

    out = ["OUT_DIR", str(tmp_path / "resumed"), *common, *on["packed"]]
    env = clean_env(FAULT_SIGNAL_AT_STEP=str(STEPS_ONE + 13), FAULT_SIGNAL="SIGTERM")
    # A launch: the run is stopped by a real SIGTERM to its process.
    preempted = run(python(TINY_TRAIN, *out), timeout=300, env=env)
    assert preempted.returncode == 75, preempted.stderr[-3000:]
    resumed = in_process(TINY_TRAIN, *out)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "_it_" in resumed.stdout
    _assert_same_weights(_final_state(tmp_path / "resumed"), reference)


@pytest.mark.slow
def test_a_run_reads_the_shards_over_http_exactly_as_from_disk(packed, http_url, tmp_path):
    """One process each (in this one): ranks and workers sharing a node's cache over HTTP, as from
    disk, are tests/integration/test_shard_cache.py's two-node test."""
    metrics = {}
    for name, root in (("disk", str(packed)), ("http", http_url)):
        data = ["TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.SHARD_CACHE", str(tmp_path / f"cache_{name}")]
        assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(tmp_path / name), *TINY, "OPTIM.MAX_EPOCH", "1", *data))
        metrics[name] = [_without_timings(r) for r in read_metrics(tmp_path / name)]
    assert metrics["http"] == metrics["disk"] and len(metrics["disk"]) == 2
    cached = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache_http").iterdir() if p.name != ".locks")
    assert cached == sorted([f"shard-00000{i}.tar" for i in range(5)] + ["shard-000000.tar", "shard-000001.tar"])
    links = list((tmp_path / "cache_disk").iterdir())
    assert len(links) == 7 and all(p.is_symlink() and p.resolve().parent.parent == packed.resolve() for p in links), (
        "local shards are read in place, not copied"
    )


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory) -> Path:
    """data/digits as a Hugging Face DatasetDict saved with save_to_disk (images embedded as bytes)."""
    datasets = pytest.importorskip("datasets")
    splits = {}
    for split in ("train", "val"):
        folder = CheckedImageFolder(str(DIGITS / split))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=folder.classes)})
        rows = {
            "image": [{"bytes": open(p, "rb").read(), "path": None} for p, _ in folder.samples],
            "label": folder.targets,
        }
        splits[split] = datasets.Dataset.from_dict(rows, features=features)
    out = tmp_path_factory.mktemp("hf") / "digits"
    datasets.DatasetDict(splits).save_to_disk(str(out))
    return out


def test_saved_hugging_face_dataset_reads_and_evaluates_as_the_imagefolder(saved_hf):
    folder = CheckedImageFolder(str(DIGITS / "val"), "pil")
    hf, classes = build_base_dataset(str(saved_hf), "val", "pil")
    assert classes == folder.classes and hf.targets == folder.targets
    for i in range(0, len(folder), 5):
        assert torch.equal(_pixels(hf[i][0]), _pixels(folder[i][0])), f"sample {i}"
    cfg = get_cfg_defaults()
    cfg.TEST.IM_SIZE, cfg.TRAIN.IM_SIZE, cfg.TEST.BATCH_SIZE, cfg.TRAIN.WORKERS = 16, 16, 50, 0
    reference = _eval_predictions(cfg, 1)
    cfg.TEST.DATASET = str(saved_hf)
    assert _eval_predictions(cfg, 2) == reference


def test_training_from_a_saved_hugging_face_dataset_gets_the_imagefolders_batches(saved_hf):
    """The training loader of 2 ranks, resumed mid-epoch, hands over the very batches (pixels after
    the seeded augmentation, targets) of the ImageFolder it was saved from, with 2 workers."""
    cfg = get_cfg_defaults()
    cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.WORKERS, cfg.DATA.DECODER = 16, 32, 2, "pil"
    batches = {}
    for name, root in (("folder", str(DIGITS)), ("hf", str(saved_hf))):
        cfg.TRAIN.DATASET = root
        for rank in (0, 1):
            split = build_train_split(cfg, DistEnv(rank=rank, world_size=2))
            split.sampler.set_epoch(3)
            split.sampler.set_position(131)  # a mid-epoch resume (from another world size)
            batches[name, rank] = [b for _, b in zip(range(4), split.loader)]
    for rank in (0, 1):
        for (a, ta, _), (b, tb, _) in zip(batches["folder", rank], batches["hf", rank], strict=True):
            assert torch.equal(a, b) and torch.equal(ta, tb)


def test_cifar_arrays_pack_as_png_and_read_back_exactly(tmp_path, monkeypatch):
    """CIFAR has no files: its uint8 arrays are packed as PNG (lossless). torchvision's CIFAR checks
    its archives' MD5, so a stand-in with CIFAR's attributes (data, targets, classes) is packed here."""
    import numpy as np

    from distribuuuu.data import pack

    class FakeCifar:
        data = np.random.default_rng(0).integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
        targets = [0, 1, 2, 0, 1, 2, 0]
        classes = ["plane", "car", "bird"]

    monkeypatch.setattr(
        pack, "build_base_dataset", lambda root, split, decoder, annotations=None: (FakeCifar, FakeCifar.classes)
    )
    report = pack_split("cifar10:/nowhere", "train", str(tmp_path), PackOptions(shard_size=3, shuffle_seed=None))
    assert (report.shards, report.samples) == (3, 7)
    pk = PackedDataset(str(tmp_path), "train", "pil", cache_dir=str(tmp_path / "cache"))
    assert pk.classes == FakeCifar.classes and pk.targets == FakeCifar.targets
    for i in range(7):
        assert np.array_equal(np.asarray(pk[i][0]), FakeCifar.data[i])


# ------------------------------------------------------------------------------------------------
# Packing shuffles the samples across shards (the tool's default): every shard mixes the classes,
# each sample is held once and reads back by name as from the unshuffled pack; the seed alone
# decides the shards, byte for byte, and an interrupted pack resumes to them.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory) -> Path:
    """data/digits packed by the tool with its default order (shuffled, seed 0), 300 a shard."""
    out = tmp_path_factory.mktemp("shuffled") / "digits"
    result = in_process(PACK, str(DIGITS), str(out), "--shard-size", str(SHARD_SIZE))
    assert_ok(result)
    assert "train: 1436 samples in 5 shards (5 written, 0 kept)" in result.stdout
    return out


def _shard_contents(folder: Path) -> list[list[tuple[str, int, bytes]]]:
    """Each shard's samples as (key, class, image bytes), read with tarfile: independent of the reader."""
    import tarfile

    shards = []
    for shard in json.loads((folder / "index.json").read_text())["shardlist"]:
        with tarfile.open(folder / shard["url"]) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        keys = sorted({name.split(".")[0] for name in files})
        image = {name.split(".")[0]: data for name, data in files.items() if not name.endswith(".cls")}
        shards.append([(key, int(files[f"{key}.cls"]), image[key]) for key in keys])
    return shards


def _names_by_shard(folder: Path) -> list[set[str]]:
    index = json.loads((folder / "index.json").read_text())
    names, shards = iter(name for name, _ in index["samples"]), []
    for shard in index["shardlist"]:
        shards.append({next(names) for _ in range(shard["nsamples"])})
    return shards


def test_packing_mixes_the_classes_in_every_shard_and_holds_each_sample_once(shuffled, packed):
    """The tars, read with tarfile: rows 0..n-1 in order, each image file's bytes and class once
    (the index names each row's sample), every class in every train shard, where the unshuffled
    pack of the same digits holds at most 3 classes a shard."""
    for split in ("train", "val"):
        folder = CheckedImageFolder(str(DIGITS / split))
        files = {os.path.relpath(p, DIGITS / split): (t, Path(p).read_bytes()) for p, t in folder.samples}
        index = json.loads((shuffled / split / "index.json").read_text())
        rows = [sample for shard in _shard_contents(shuffled / split) for sample in shard]
        assert [key for key, _, _ in rows] == [key_of(r) for r in range(len(files))]
        assert [t for _, t in index["samples"]] == [t for _, t, _ in rows], "the index's targets are the shards'"
        held = {name: (t, data) for (name, _), (_, t, data) in zip(index["samples"], rows, strict=True)}
        assert len(held) == len(rows) and held == files, f"{split}: each file once, its bytes and class"
        assert index["packing"]["shuffle_seed"] == 0
    assert [len({t for _, t, _ in s}) for s in _shard_contents(shuffled / "train")] == [10] * 5
    assert max(len({t for _, t, _ in s}) for s in _shard_contents(packed / "train")) <= 3
    assert json.loads((packed / "train" / "index.json").read_text())["packing"]["shuffle_seed"] is None


def test_shuffled_pack_reads_back_each_names_bytes_and_target_as_unshuffled(shuffled, packed):
    for split in ("train", "val"):
        mixed, plain = PackedDataset(str(shuffled), split), PackedDataset(str(packed), split)
        assert mixed.classes == plain.classes
        assert [n for n, _ in mixed.samples] != [n for n, _ in plain.samples], "a new order"
        expected = {plain.samples[i][0]: plain.encoded(i)[::2] for i in range(len(plain))}
        read = {mixed.samples[i][0]: mixed.encoded(i)[::2] for i in range(len(mixed))}
        assert len(read) == len(mixed) and read == expected, f"{split}: (bytes, target) per name"


def test_exact_eval_of_a_shuffled_pack_is_the_imagefolders_by_name(shuffled):
    cfg = get_cfg_defaults()
    cfg.TEST.IM_SIZE, cfg.TRAIN.IM_SIZE, cfg.TEST.BATCH_SIZE, cfg.TRAIN.WORKERS = 16, 16, 50, 0
    folder = [os.path.relpath(p, DIGITS / "val") for p, _ in CheckedImageFolder(str(DIGITS / "val")).samples]
    reference = {folder[i]: result for i, result in _eval_predictions(cfg, 1).items()}
    cfg.TEST.DATASET = str(shuffled)
    mixed = PackedDataset(str(shuffled), "val")
    for world in (1, 3):
        by_name = {mixed.samples[i][0]: result for i, result in _eval_predictions(cfg, world).items()}
        assert by_name == reference, f"world size {world}"


def test_the_seed_decides_the_shards_same_seed_same_bytes_another_seed_another_mix(shuffled, tmp_path):
    """Seed 0 packed here (this process) gives the tool's shards (another process) byte for byte;
    seed 1 puts the same samples in other shards."""
    pack_split(str(DIGITS), "train", str(tmp_path / "seed0"), PackOptions(shard_size=SHARD_SIZE))
    for shard in sorted((shuffled / "train").glob("*.tar")):
        assert (tmp_path / "seed0" / "train" / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert (tmp_path / "seed0" / "train" / "index.json").read_text() == (shuffled / "train" / "index.json").read_text()
    pack_split(str(DIGITS), "train", str(tmp_path / "seed1"), PackOptions(shard_size=SHARD_SIZE, shuffle_seed=1))
    seed0, seed1 = _names_by_shard(shuffled / "train"), _names_by_shard(tmp_path / "seed1" / "train")
    assert all(a != b for a, b in zip(seed0, seed1, strict=True)), "every shard holds other samples"
    assert set().union(*seed0) == set().union(*seed1)
    assert json.loads((tmp_path / "seed1" / "train" / "index.json").read_text())["packing"]["shuffle_seed"] == 1


def test_interrupted_shuffled_pack_run_again_writes_the_same_shards(shuffled, tmp_path):
    """The resume of the block above with the tool's default shuffle (seed 0); then another seed
    rewrites every shard (their fingerprints name other samples)."""
    _assert_interrupted_pack_resumes_to(shuffled, PackOptions(shard_size=SHARD_SIZE), tmp_path)
    reseeded = PackOptions(shard_size=SHARD_SIZE, shuffle_seed=1)
    assert pack_split(str(DIGITS), "train", str(tmp_path), reseeded).written == 5, "a new seed: new shards"


def test_pack_tool_takes_a_seed_or_no_shuffle_and_refuses_a_negative_seed(tmp_path):
    negative = in_process(PACK, str(DIGITS), str(tmp_path / "out"), "--shuffle-seed", "-1")
    assert negative.returncode == 2 and "--shuffle-seed must be >= 0, got -1 (--no-shuffle" in negative.stderr
    both = in_process(PACK, str(DIGITS), str(tmp_path / "out"), "--shuffle-seed", "3", "--no-shuffle")
    assert both.returncode == 2 and "not allowed with argument --shuffle-seed" in both.stderr
    assert not (tmp_path / "out").exists(), "nothing packed"
