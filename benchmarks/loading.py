"""Data-pipeline speed: the loader's steady rate per worker count, the workers' side alone, each
decoder on synthetic photos (PIL, torchvision, batched), and packed shards against the ImageFolder."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from yacs.config import CfgNode

from benchmarks.report import DECODE_BATCH, MIXED_SIZES, MIXED_WEIGHTS, PHOTO_SIZE, REENCODE, Report, bench_cfg, spread
from distribuuuu.config import ConfigError
from distribuuuu.data import jpeg, load_image
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import (
    all_reduce_sum,
    barrier,
    broadcast_object,
)
from distribuuuu.training.inputs import build_train_split


# ------------------------------------------------------------------------------------------------
# Data pipeline and decoding
# ------------------------------------------------------------------------------------------------
def steady_rate(loader, timed: int, workers: int, queued: int) -> tuple[float, int]:
    """Images/s of a DataLoader's steady state: ``timed`` batches, rounded to whole rounds of its workers.

    Each worker decodes ahead of the consumer: when the first batch arrives, up to ``queued``
    (workers x prefetch factor) are on the way, and the workers finish their batches in rounds of
    ``workers``. Timing a window that drains that queue, or that starts and ends at other points
    of a round, counts work done before the timer as if it were free (on an H100 host, 15 workers
    timing 12 batches gave PIL 25,558 img/s, more than 15 single-core decoders can do). So the
    start-up and the queued batches go untimed, and the window spans whole rounds: its two ends
    fall at the same point of a round, and it measures the rate the workers sustain.
    """
    it = iter(loader)
    for _ in range(1 + queued):
        next(it)
    rounds = max(1, workers)
    n = max(rounds, timed // rounds * rounds)
    tic = time.perf_counter()
    images = 0
    for _ in range(n):
        batch = next(it)
        images += len(batch[1])
    if isinstance(batch[0], torch.Tensor) and batch[0].is_cuda:  # DATA.DECODER batched: the device's work too
        torch.cuda.synchronize(batch[0].device)
    return images / (time.perf_counter() - tic), images


def pipeline_name(cfg: CfgNode) -> str:
    """The decoder, and for "batched" which augmentation: the batched resample or per sample."""
    batched_per_sample = cfg.DATA.DECODER == "batched" and not cfg.DATA.BATCHED_AUGMENT
    return "batched-per-sample" if batched_per_sample else cfg.DATA.DECODER


def worker_side_rate(cfg: CfgNode, env: DistEnv, batches: int) -> float:
    """Images/s one worker process sustains: the training split's dataset and collate in this
    process (TRAIN.WORKERS 0), without the training process's decode: for DATA.DECODER batched,
    reading bytes and headers and drawing the crops."""
    split = build_train_split(cfg, env)
    loader = split.loader.loader  # the DataLoader under DeviceLoader: the workers' side alone
    it = iter(loader)
    next(it)
    tic, images = time.perf_counter(), 0
    for _, batch in zip(range(batches), it):
        images += len(batch)
    return images / (time.perf_counter() - tic)


def loader_rate(cfg: CfgNode, env: DistEnv, batches: int) -> tuple[float, int]:
    """Images/s of this rank's training loader (dataset, transforms, collate) in its steady state."""
    split = build_train_split(cfg, env)  # a new sampler starts at epoch 0, sample 0
    workers = cfg.TRAIN.WORKERS
    queued = workers * cfg.TRAIN.PREFETCH_FACTOR  # the DataLoader's tasks in flight (the pinning thread's too)
    needed = 1 + queued + max(1, workers)
    if len(split.loader) < needed:
        raise ConfigError(
            f"the training split has {len(split.loader)} batches of TRAIN.BATCH_SIZE {cfg.TRAIN.BATCH_SIZE} "
            f"a rank; timing the data pipeline with {workers} workers needs {needed} (more images or smaller batches)"
        )
    timed = min(batches, len(split.loader) - 1 - queued)
    rate, images = steady_rate(split.loader, timed, workers, queued)
    del split  # shut the workers down before the next measurement
    return rate, images


def measure_data(cfg_args, env: DistEnv, bench, report: Report, label: str = "data", *extra: str) -> None:
    """Data-pipeline images/s alone (no model), for each worker count."""
    for workers in bench.workers:
        cfg = bench_cfg(cfg_args, *extra, "TRAIN.WORKERS", str(workers))
        barrier()
        rate, images = loader_rate(cfg, env, bench.data_batches)
        total = all_reduce_sum(torch.tensor([rate], dtype=torch.float64, device=env.device)).item()
        report.emit(
            {
                "what": label,
                "dataset": cfg.TRAIN.DATASET,
                "decoder": pipeline_name(cfg),
                "workers": workers,
                "world_size": env.world_size,
                "batch_per_proc": cfg.TRAIN.BATCH_SIZE,
                "im_size": cfg.TRAIN.IM_SIZE,
                "images_timed_per_proc": images,
                "images_per_s_per_proc": rate,
                "images_per_s": total,
            }
        )


def make_photo_folder(root: str, count: int, seed: int = 0, mixed: bool = False) -> str:
    """Write ``count`` synthetic JPEG photos (smooth colour fields plus grain) as an ImageFolder:
    500x375, or ImageNet-like mixed sizes (MIXED_SIZES) with ``mixed``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", count), ("val", max(2, count // 4))):
        for i in range(n):
            folder = os.path.join(root, split, f"class{i % 2}")
            os.makedirs(folder, exist_ok=True)
            w, h = MIXED_SIZES[rng.choice(len(MIXED_SIZES), p=MIXED_WEIGHTS)] if mixed else PHOTO_SIZE
            # Low-frequency structure compresses like a photo; the grain keeps the file realistic (~60 KB).
            coarse = rng.uniform(0, 255, (h // 25 + 1, w // 25 + 1, 3)).astype(np.uint8)
            smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.float32)
            pixels = np.clip(smooth + rng.normal(0, 8, smooth.shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)
    return root


def decode_files(files: list[str], decoder: str, device: torch.device, batch: int) -> None:
    """Decode every file as DATA.DECODER would: one at a time, or ``batch`` JPEGs per decode_jpegs call
    (TorchCodec's or torchvision's, as data/jpeg.py picks)."""
    if decoder != "batched":
        for path in files:
            load_image(path, decoder)
        return
    for i in range(0, len(files), batch):
        data = [
            torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8) for path in files[i : i + batch]
        ]
        jpeg.decode_jpegs(data, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The full pipelines measure_decode times: each decoder, and "batched" with its batched resample
# (the default) and with the per-sample transforms after the batched decode (DATA.BATCHED_AUGMENT False).
PIPELINES = (("pil", ()), ("torchvision", ()), ("batched", ()), ("batched", ("DATA.BATCHED_AUGMENT", "False")))


def measure_worker_side(cfg: CfgNode, env: DistEnv, bench, report: Report) -> None:
    """What one DataLoader worker sustains for a batched pipeline: how many workers a GPU needs."""
    rates = [worker_side_rate(cfg, env, bench.data_batches) for _ in range(bench.repeats)]
    report.emit(
        {
            "what": "worker_side",
            "decoder": pipeline_name(cfg),
            "batch_per_proc": cfg.TRAIN.BATCH_SIZE,
            "images_per_s_per_worker": statistics.median(rates),
            **spread(rates, "images_per_s"),
        }
    )


def measure_decode(cfg_args, env: DistEnv, bench, report: Report) -> None:
    """PIL vs torchvision.io vs batched decode_jpeg on 500x375 JPEGs: decode alone, then the full pipeline."""
    root = tempfile.mkdtemp(prefix="distribuuuu-photos-") if env.is_main_process else None
    try:
        if env.is_main_process:
            make_photo_folder(root, bench.photos)
        root = broadcast_object(root)
        barrier()
        photo_batch = max(1, min(8, bench.photos // (4 * env.world_size)))  # at least 2 batches per rank
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "train")) for f in fs)
        decode_batch = min(DECODE_BATCH, len(files))
        decoders = ("pil", "torchvision", "batched")
        rates = {decoder: [] for decoder in decoders}
        for decoder in decoders:
            decode_files(files[:decode_batch], decoder, env.device, decode_batch)  # warm-up (nvJPEG starts)
        for _ in range(bench.repeats):  # decoders in turn, so drift on a shared machine hits all alike
            for decoder in decoders:
                tic = time.perf_counter()
                decode_files(files, decoder, env.device, decode_batch)
                rates[decoder].append(len(files) / (time.perf_counter() - tic))
        for decoder in decoders:
            report.emit(
                {
                    "what": "decode",
                    "decoder": decoder,
                    "device": str(env.device) if decoder == "batched" else "cpu",
                    "batch": decode_batch if decoder == "batched" else 1,
                    "image": f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} synthetic JPEG q90",
                    "images": len(files),
                    "repeats": bench.repeats,
                    "images_per_s_per_proc": statistics.median(rates[decoder]),
                    **spread(rates[decoder], "images_per_s"),
                }
            )
        for decoder, extra in PIPELINES:
            photo = ("TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.DECODER", decoder, *extra)
            photo += ("TRAIN.IM_SIZE", "224", "TEST.IM_SIZE", "256", "TRAIN.BATCH_SIZE", str(photo_batch))
            measure_data(cfg_args, env, bench, report, "decode_pipeline", *photo)
            if decoder == "batched":
                measure_worker_side(bench_cfg(cfg_args, *photo, "TRAIN.WORKERS", "0"), env, bench, report)
        barrier()
    finally:
        if env.is_main_process and root:
            shutil.rmtree(root, ignore_errors=True)


def _pack_variants(root: str) -> tuple[str, str, dict]:
    """Pack ``root`` as is and re-encoded (REENCODE); return both roots and what re-encoding costs."""
    from PIL import Image

    from distribuuuu.data.pack import PackOptions, pack_split

    raw, small = os.path.join(root, "packed"), os.path.join(root, f"packed-{REENCODE[0]}q{REENCODE[1]}")
    for split in ("train", "val"):
        pack_split(os.path.join(root, "photos"), split, raw, PackOptions(shard_size=500))
        pack_split(os.path.join(root, "photos"), split, small, PackOptions(500, *REENCODE))
    photos = os.path.join(root, "photos", "train")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(photos) for f in fs)
    pixels = sum(w * h for w, h in (Image.open(f).size for f in files))
    scale = [min(1.0, REENCODE[0] / max(Image.open(f).size)) for f in files]
    cost = {
        "reencode": f"longer side <= {REENCODE[0]} px, JPEG quality {REENCODE[1]}",
        "pixels_kept": sum(s * s * w * h for s, (w, h) in zip(scale, (Image.open(f).size for f in files))) / pixels,
        "bytes_kept": _tree_bytes(os.path.join(small, "train")) / _tree_bytes(os.path.join(raw, "train")),
    }
    return raw, small, cost


def _tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".tar"))


def measure_packed(cfg_args, env: DistEnv, bench, report: Report) -> None:
    """The 224-pixel training pipeline on the same mixed-size JPEGs: ImageFolder (PIL, torchvision.io)
    against packed shards (as is and re-encoded; torchvision.io and DATA.DECODER draft), for each
    worker count. Paths are measured in turn within each repetition, so load drift hits all alike."""
    root = tempfile.mkdtemp(prefix="distribuuuu-packed-") if env.is_main_process else None
    try:
        if env.is_main_process:
            make_photo_folder(os.path.join(root, "photos"), bench.photos, mixed=True)
            raw, small, cost = _pack_variants(root)
        root = broadcast_object(root)
        raw, small, cost = broadcast_object((raw, small, cost) if env.is_main_process else None)
        photos, tag = os.path.join(root, "photos"), f"packed-{REENCODE[0]}q{REENCODE[1]}"
        paths = {
            "folder+pil": (photos, "pil"),
            "folder+torchvision": (photos, "torchvision"),
            "packed+torchvision": (raw, "torchvision"),
            "packed+draft": (raw, "draft"),
            f"{tag}+torchvision": (small, "torchvision"),
            f"{tag}+draft": (small, "draft"),
        }
        rates = {(p, w): [] for p in paths for w in bench.workers}
        for _ in range(bench.repeats):
            for workers in bench.workers:
                for label, (data, decoder) in paths.items():
                    cfg = bench_cfg(
                        cfg_args, "TRAIN.DATASET", data, "TEST.DATASET", data, "DATA.DECODER", decoder,
                        "TRAIN.IM_SIZE", "224", "TEST.IM_SIZE", "256", "TRAIN.WORKERS", str(workers),
                        "DATA.SHARD_CACHE", os.path.join(root, "shard-links"),  # removed with root
                    )  # fmt: skip
                    barrier()
                    rates[label, workers].append(loader_rate(cfg, env, bench.data_batches)[0])
        for (label, workers), values in rates.items():
            rate = statistics.median(values)
            paired = [v / ref for v, ref in zip(values, rates["folder+pil", workers])]  # same repetition
            report.emit(
                {
                    "what": "packed_pipeline",
                    "path": label,
                    "workers": workers,
                    "world_size": env.world_size,
                    "im_size": 224,
                    "photos": bench.photos,
                    "repeats": bench.repeats,
                    "images_per_s_per_proc": rate,
                    "images_per_s_per_core": rate / max(1, workers),  # workers do the work; 0: the process
                    "over_folder_pil_paired_median": statistics.median(paired),
                    **spread(values, "images_per_s"),
                    **(cost if tag in label else {}),
                }
            )
        barrier()
    finally:
        if env.is_main_process and root:
            shutil.rmtree(root, ignore_errors=True)
