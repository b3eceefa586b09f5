"""What every measurement of tools/benchmark.py shares: its config (the user's, or on in-memory
synthetic data), the settings a figure depends on, its spread over repetitions, a whole-job clock,
peak memory, and the report that prints each as a JSON line."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable

import torch
from yacs.config import CfgNode

from distribuuuu.config import load_cfg
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import barrier
from distribuuuu.training.state import global_batch

# ------------------------------------------------------------------------------------------------
# Training: the trainer's own loop and a hand-written one
# ------------------------------------------------------------------------------------------------
PHOTO_SIZE = (500, 375)  # width, height: a typical ImageNet photo
# --what packed: ImageNet-like mixed sizes (width, height), drawn with these weights.
MIXED_SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (640, 480), (800, 600), (1024, 768), (400, 300))
MIXED_WEIGHTS = (0.3, 0.15, 0.15, 0.1, 0.1, 0.08, 0.04, 0.08)
REENCODE = (320, 90)  # --what packed's re-encoded variant: longer side <= 320 px, JPEG quality 90
DECODE_BATCH = 32  # JPEGs per decode_jpeg call when timing DATA.DECODER "batched" alone
SYNTHETIC_STEPS = 30  # steps per repetition of the synthetic measurements when --steps is 0


def bench_cfg(cfg_args: argparse.Namespace, *extra: str) -> CfgNode:
    """The user's config with ``extra`` KEY VALUE overrides applied last."""
    return load_cfg(cfg_args.cfg_file, [*cfg_args.opts, *extra])


def synthetic_cfg(cfg_args: argparse.Namespace, env: DistEnv, steps: int, *extra: str) -> CfgNode:
    """The config on in-memory synthetic data sized so that one epoch is exactly ``steps`` steps (0: 30)."""
    steps = steps or SYNTHETIC_STEPS
    base = bench_cfg(cfg_args, *extra)
    size = global_batch(base.TRAIN, env.world_size) * steps
    return bench_cfg(cfg_args, *extra, "MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", str(size))


class Report:
    """Collect measurements; rank 0 prints each as one JSON line and appends it to --json."""

    def __init__(self, env: DistEnv, json_path: str):
        self.env, self.json_path, self.records = env, json_path, []

    def emit(self, record: dict) -> None:
        record = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}
        self.records.append(record)
        if not self.env.is_main_process:
            return
        line = json.dumps(record)
        print(line, flush=True)
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(line + "\n")


def spread(values: list[float], prefix: str) -> dict:
    """Median, min, max and interquartile range of ``values`` under ``prefix``."""
    q1, q3 = statistics.quantiles(values, n=4, method="inclusive")[::2] if len(values) > 1 else (values[0],) * 2
    return {
        f"{prefix}_median": statistics.median(values),
        f"{prefix}_min": min(values),
        f"{prefix}_max": max(values),
        f"{prefix}_iqr": q3 - q1,
    }


def describe(cfg: CfgNode, env: DistEnv) -> dict:
    """The settings a throughput figure depends on."""
    return {
        "arch": cfg.MODEL.ARCH,
        "world_size": env.world_size,
        "batch_per_proc": cfg.TRAIN.BATCH_SIZE,
        "accum_steps": cfg.TRAIN.ACCUM_STEPS,
        "im_size": cfg.TRAIN.IM_SIZE,
        "precision": cfg.TRAIN.PRECISION,
        "channels_last": cfg.TRAIN.CHANNELS_LAST,
        "threads_per_proc": torch.get_num_threads(),
        "device": env.device.type,
    }


def sync_device(env: DistEnv) -> None:
    """Wait for queued device work, so a clock reading covers it (no-op on the CPU)."""
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def reset_peak_memory(env: DistEnv) -> None:
    """Start a new CUDA peak-memory window (the CPU's peak RSS cannot be reset)."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)


def peak_memory_mib(env: DistEnv) -> float:
    """CUDA: peak memory allocated since reset_peak_memory; CPU: this process's peak RSS so far."""
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def timed(fn: Callable[[], object], env: DistEnv) -> float:
    """Seconds ``fn`` takes on the whole job: every rank starts together and the last one to end stops the clock."""
    barrier()
    tic = time.perf_counter()
    fn()
    sync_device(env)
    barrier()
    return time.perf_counter() - tic
