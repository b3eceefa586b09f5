"""tools/gpu_check.py's harness: a check's outcome (PASS / FAIL / SKIP on every rank), the table's
rows, the small runs the checks train (two tiny models on the embedded digits), and what they
count (host syncs, CUDA contexts, the streams kernels ran on)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import random
import shutil
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from PIL import Image
from torch import nn
from torch.distributed.tensor import DTensor

from distribuuuu import trainer
from distribuuuu.config import load_cfg
from distribuuuu.errors import EXIT_FAILED, first_line
from distribuuuu.models import register_model
from distribuuuu.records.meters import MetricSums
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.preemption import Preempted
from distribuuuu.runtime.process_group import (
    all_gather_object,
)
from distribuuuu.training import run as run_setup
from distribuuuu.training.inputs import build_train_split, build_val_split
from distribuuuu.training.rng import seed_everything
from distribuuuu.training.state import Run

DIGITS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "digits")
TINY, TINY_NO_BN = "gpu_check_tiny", "gpu_check_tiny_no_bn"


class Skip(Exception):
    """The check does not apply here; the message says why."""


class CheckFailed(Exception):
    """The check ran and found a defect (not an assert: ``python -O`` must not pass it)."""


@dataclass
class Context:
    env: DistEnv
    work_dir: str  # the same folder on every rank
    backend: str = ""  # the process group's ("gloo" lets ranks share a GPU); "" without one


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str


@register_model(TINY)
def tiny_net(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    """Two conv-BN-ReLU blocks: compiles in seconds, still has BatchNorm and a conv for cuDNN."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )  # fmt: skip


@register_model(TINY_NO_BN)
def tiny_net_without_batchnorm(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    """The tiny model without BatchNorm: under fsdp with fp16 its parameters are fp16 in forward
    (a model with BatchNorm keeps fp32 parameters and autocast, see parallel.mixed_precision_policy)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The runner: every rank runs every check; rank 0 prints the merged verdict
# ------------------------------------------------------------------------------------------------
def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def expect_close(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol=1e-4, atol=1e-5) -> None:
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        worst = (actual - expected).abs().max().item()
        raise CheckFailed(f"{what} differs: max |diff| {worst:.3g} (rtol {rtol:g}, atol {atol:g})")


def run_check(name: str, check: Callable[[Context], str], ctx: Context) -> Result:
    """Run one check on this rank; any exception is its FAIL, never the script's end."""
    tic = time.perf_counter()
    try:
        status, detail = "PASS", check(ctx) or ""
    except Preempted:  # a Ctrl-C or SIGTERM the trainer took in a check stops the tool, not the check
        raise
    except Skip as e:
        status, detail = "SKIP", str(e)
    except Exception as e:
        status, detail = "FAIL", f"{type(e).__name__}: {first_line(e)}"
    return Result(name, status, time.perf_counter() - tic, detail)


def merge_ranks(results: list[Result]) -> Result:
    """One row per check: the first failing rank's result (naming the rank), else rank 0's."""
    failed = [(rank, r) for rank, r in enumerate(results) if r.status == "FAIL"]
    rank, r = failed[0] if failed else (0, results[0])
    detail = f"rank {rank}: {r.detail}" if failed and len(results) > 1 else r.detail
    return Result(r.name, r.status, max(x.seconds for x in results), detail)


def format_row(r: Result) -> str:
    return f"{r.name:<30} {r.status:<6} {r.seconds:>7.1f}  {r.detail}"


def run_checks(checks: list[tuple[str, Callable]], ctx: Context, print_row: Callable = print) -> list[Result]:
    """Run each check on every rank, merge the ranks' verdicts and print each row as it is known."""
    print_row(f"{'check':<30} {'result':<6} {'seconds':>7}  detail")
    merged = []
    for name, check in checks:
        merged.append(merge_ranks(all_gather_object(run_check(name, check, ctx))))
        print_row(format_row(merged[-1]))
    return merged


def exit_code(results: list[Result]) -> int:
    return EXIT_FAILED if any(r.status == "FAIL" for r in results) else 0


# ------------------------------------------------------------------------------------------------
# Shared set-up of the checks
# ------------------------------------------------------------------------------------------------
def needs_cuda(ctx: Context) -> torch.device:
    if ctx.env.device.type != "cuda":
        raise Skip("no CUDA (--device cpu)")
    return ctx.env.device


def make_cfg(ctx: Context, name: str, *opts: str):
    """The digits at 16x16, batch 32, OUT_DIR under the shared work folder; ``opts`` on top.

    A trainer run logs to its OUT_DIR/log.txt only: stdout is the table's."""
    base = ["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]
    base += ["LOG.CONSOLE", "False"]
    base += ["TRAIN.BATCH_SIZE", "32", "TRAIN.PRINT_FREQ", "1000", "OUT_DIR", os.path.join(ctx.work_dir, name)]
    return load_cfg(None, [*base, *opts])


def build_tiny_run(ctx: Context, name: str, *opts: str) -> tuple[Run, list]:
    """The trainer's Run for the tiny model (DDP when there are several ranks) and one fixed batch."""
    cfg = make_cfg(ctx, name, "MODEL.ARCH", TINY, "OPTIM.BASE_LR", "0.1", *opts)
    seed_everything(cfg.RNG_SEED + ctx.env.rank)
    run = run_setup.build_run(cfg, ctx.env)
    return run, [next(iter(run.train.loader))]


def train_steps(run: Run, batch: list, steps: int) -> list[float]:
    """Train ``steps`` steps of the trainer's own train_step on one batch; return the losses."""
    sums = MetricSums(run.env.device, run.cfg.TRAIN.TOPK)
    return [trainer.train_step(run, batch, sums).item() for _ in range(steps)]


def loss_falls(ctx: Context, name: str, *opts: str, steps: int = 6) -> str:
    run, batch = build_tiny_run(ctx, name, *opts)
    losses = train_steps(run, batch, steps)
    expect(all(map(math.isfinite, losses)), f"non-finite loss: {losses}")
    expect(losses[-1] < losses[0], f"loss did not fall on a fixed batch: {losses}")
    return f"{steps} steps on one batch: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state, whole and on the CPU (all ranks call it: fsdp gathers shards)."""
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


def jpeg_dataset(ctx: Context) -> tuple[str, ...]:
    """Options for this rank's JPEG/PNG digits subset (jpeg_tree) in batches of 8: 5 batches a rank
    for up to 32 ranks (the digits hold ~143 training images a class)."""
    root = os.path.join(ctx.work_dir, f"jpeg_windows_rank{ctx.env.rank}")
    if not os.path.isdir(root):
        jpeg_tree(root, per_class=4 * ctx.env.world_size + 4)
    return ("TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.DECODER", "batched", "TRAIN.BATCH_SIZE", "8")


@contextlib.contextmanager
def host_syncs_raise(device: torch.device):
    """Between two sync points: any call that makes the host wait for the GPU raises (sync debug mode).

    The error names the frame of this package nearest the call, as a FAIL row would not. On the
    CPU nothing is watched: the code between still runs, so the CPU tests exercise it."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "distribuuuu" in f.filename]
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}" if frames else ""
        raise CheckFailed(f"host sync{where}: {first_line(e)}") from None
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def counting_host_syncs(device: torch.device):
    """Collect a message per call that makes the host wait for the GPU (sync debug mode "warn").

    For code allowed a known number of syncs; on the CPU nothing is counted, the code still runs."""
    syncs: list[str] = []
    if device.type != "cuda":
        yield syncs
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs += [first_line(w.message) for w in caught if "synchroniz" in str(w.message)]


def window_without_sync(ctx: Context, name: str, *opts: str, steps: int = 3, syncs_per_step: int = 0) -> list[float]:
    """Train ``steps`` steps, loader included, between two sync points: no host sync (they raise),
    or at most ``syncs_per_step`` a step (counted)."""
    run, _ = build_tiny_run(ctx, name, *opts)
    batches = iter(run.train.loader)
    sums = MetricSums(run.env.device, run.cfg.TRAIN.TOPK)
    for _ in range(2):  # the first steps allocate, pick kernels and may sync: not the steady loop
        trainer.train_step(run, [next(batches)], sums).item()
    watch = counting_host_syncs(run.env.device) if syncs_per_step else host_syncs_raise(run.env.device)
    with watch as syncs:
        losses = [trainer.train_step(run, [next(batches)], sums) for _ in range(steps)]
    if syncs_per_step:
        expect(len(syncs) <= syncs_per_step * steps, f"{len(syncs)} host syncs in {steps} steps: {syncs[:1]}")
    values = torch.stack(losses).tolist()  # the window's sync point, as the trainer's every PRINT_FREQ steps
    expect(all(map(math.isfinite, values)), f"non-finite loss: {values}")
    return values


# ------------------------------------------------------------------------------------------------
# The checks: each returns a one-line detail, raises Skip, or fails by raising
# ------------------------------------------------------------------------------------------------
def physical_device(env: DistEnv) -> str:
    """The GPU's UUID, not its index: with one GPU bound per task, every rank sees cuda:0."""
    return str(torch.cuda.get_device_properties(env.device).uuid) if env.device.type == "cuda" else f"cpu{env.rank}"


def jpeg_tree(root: str, per_class: int = 12) -> str:
    """A digits subset in which about half the images, drawn with a fixed seed, are re-saved as JPEGs.

    Batches mix both kinds on every rank: each takes every W-th sample (ExactEvalSampler), and with
    every other image a JPEG and an even number per class, rank 0 of 2 (or of 8) got PNGs alone."""
    draw = random.Random(0)
    for split in ("train", "val"):
        for cls in sorted(os.listdir(os.path.join(DIGITS, split))):
            os.makedirs(os.path.join(root, split, cls), exist_ok=True)
            for name in sorted(os.listdir(os.path.join(DIGITS, split, cls)))[:per_class]:
                src, stem = os.path.join(DIGITS, split, cls, name), os.path.splitext(name)[0]
                if draw.random() < 0.5:
                    Image.open(src).convert("RGB").save(os.path.join(root, split, cls, f"{stem}.jpg"), quality=90)
                else:
                    shutil.copy(src, os.path.join(root, split, cls, name))
    return root


def augment_syncs(ctx: Context, name: str, *augment: str, batches: int = 3) -> tuple[int, int]:
    """Host syncs while the batched decoder's loader decodes and augments ``batches`` batches; and the images."""
    loader = iter(build_train_split(make_cfg(ctx, name, *jpeg_dataset(ctx), *augment), ctx.env).loader)
    next(loader)  # workers start, nvJPEG initialises
    with counting_host_syncs(ctx.env.device) as syncs:
        images = [next(loader)[0] for _ in range(batches)]
    expect(all(bool(torch.isfinite(x).all()) for x in images), f"a batch augmented by {augment} is not finite")
    return len(syncs), sum(len(x) for x in images)


# ------------------------------------------------------------------------------------------------
# The prepare thread of DATA.DECODER batched on a node of several GPUs (data/prefetch.py)
# ------------------------------------------------------------------------------------------------
def primary_contexts() -> set[int]:
    """The visible GPUs on which this process holds a primary CUDA context, as the driver says
    (cuDevicePrimaryCtxGetState): what nvidia-smi counts as this process on a GPU."""
    driver = ctypes.CDLL("libcuda.so.1")
    active, flags, found = ctypes.c_int(), ctypes.c_uint(), set()
    for ordinal in range(torch.cuda.device_count()):
        handle = ctypes.c_int()
        if driver.cuDeviceGet(ctypes.byref(handle), ordinal) != 0:
            continue
        if driver.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)) == 0 and active.value:
            found.add(ordinal)
    return found


def batched_val_passes(ctx: Context, name: str, passes: int, *opts: str, each: Callable = lambda batch: None) -> list:
    """``passes`` whole passes of the batched decoder's val loader (the same batches each time:
    nothing legitimately grows); ``memory_reserved`` after each (CUDA; 0 on the CPU)."""
    loader = build_val_split(make_cfg(ctx, name, *jpeg_dataset(ctx), *opts), ctx.env).loader
    reserved = []
    for _ in range(passes):
        for batch in loader:
            each(batch)
        cuda = ctx.env.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(ctx.env.device)
        reserved.append(torch.cuda.memory_reserved(ctx.env.device) if cuda else 0)
    return reserved


def kernel_streams(events: list[dict], thread: int) -> tuple[set, set]:
    """From a chrome trace's events: the streams of the kernels launched by CPU thread ``thread``,
    and those of NCCL's kernels."""
    launched_by = {
        e["args"]["correlation"]: e["tid"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    mine, nccl = set(), set()
    for e in events:
        if e.get("cat") != "kernel":
            continue
        stream, correlation = e["args"].get("stream"), e["args"].get("correlation")
        if "nccl" in e.get("name", "").lower():
            nccl.add(stream)
        elif launched_by.get(correlation) == thread:
            mine.add(stream)
    return mine, nccl
