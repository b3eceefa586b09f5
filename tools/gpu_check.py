"""GPU acceptance check: run what the CPU-only test suite cannot, and print a pass/fail table.

    torchrun --nproc_per_node=8 tools/gpu_check.py     # every check, SyncBatchNorm across 8 GPUs
    torchrun --nproc_per_node=1 tools/gpu_check.py     # or: python tools/gpu_check.py
    torchrun --nproc_per_node=2 tools/gpu_check.py --device cpu   # developers: gloo on the CPU
    torchrun --nproc_per_node=2 tools/gpu_check.py --backend gloo # two ranks sharing one GPU (gloo)

It takes well under 5 minutes on one node: each check trains a few steps or two short epochs on
the embedded data/digits at 16x16 pixels. Rank 0 prints one row per check (name, PASS / FAIL /
SKIP, seconds, one line of detail) as it finishes; a check fails when it fails on any rank, and a
failing check does not stop the others. Exit status: 0 if no check failed, 1 if one did, 2 if
there is nothing to check (no CUDA GPU visible: one line says so) or the launch is wrong.

``--device cpu`` runs the checks that make sense without CUDA (all-reduce and rank table with
gloo, fp16 and bf16 autocast, channels_last, fsdp with DCP checkpoints and ShardedGradScaler,
resume) and skips the CUDA-only ones with a reason; the sync-debug checks still train and augment
before skipping, so their code runs. The test suite runs it that way. Trainer runs write to a
temporary folder, removed at the end; ``--work-dir DIR`` keeps them, and ranks on several nodes
need it, on a filesystem every node shares (without it the tool refuses in one line). A check that
fails on some ranks only, inside a collective, may hold the others until the 300 s timeout.

``--backend gloo`` runs the CUDA checks over gloo, which (unlike NCCL) lets several ranks share one
GPU: on a machine with one GPU that is the only way to run the checks that need two ranks
(SyncBatchNorm's statistics, fsdp's shards). A collective gloo refuses on CUDA tensors is that
check's FAIL row, with gloo's message.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from distribuuuu import trainer  # noqa: E402
from distribuuuu.checkpointing import checkpoint as ckpt  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402
from distribuuuu.data import batched  # noqa: E402
from distribuuuu.errors import EXIT_INTERRUPTED, first_line  # noqa: E402
from distribuuuu.models import register_model  # noqa: E402
from distribuuuu.records.meters import MetricSums  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv, LaunchError, detect_env, detect_env_rank  # noqa: E402
from distribuuuu.runtime.preemption import Preempted  # noqa: E402
from distribuuuu.runtime.process_group import (  # noqa: E402
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    check_group,
    cleanup_distributed,
    setup_distributed,
)
from distribuuuu.training import parallelize  # noqa: E402
from distribuuuu.training import run as run_setup  # noqa: E402
from distribuuuu.training.inputs import build_train_split, build_val_split  # noqa: E402
from distribuuuu.training.preprocessing import build_normalize  # noqa: E402
from distribuuuu.training.resume import checkpointer, resume_or_load_weights, save_training_checkpoint  # noqa: E402
from distribuuuu.training.rng import seed_everything  # noqa: E402
from distribuuuu.training.state import Run  # noqa: E402

EXIT_FAILED, EXIT_NOTHING_TO_CHECK = 1, 2
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


def check_all_reduce(ctx: Context) -> str:
    """An all-reduce has the closed-form sum; the rank table shows every rank on a GPU of its own."""
    env, n, w = ctx.env, 1024, ctx.env.world_size
    values = all_reduce_sum(torch.arange(n, dtype=torch.float32, device=env.device) * (env.rank + 1))
    expected = torch.arange(n, dtype=torch.float32) * (w * (w + 1) // 2)
    expect(torch.equal(values.cpu(), expected), f"sum of (rank+1)*arange({n}) is not {w * (w + 1) // 2}*arange")
    rows = check_group(env, timeout_s=30)
    devices = [r["device"] for r in rows]
    expect([r["rank"] for r in rows] == list(range(w)), f"rank table lists ranks {[r['rank'] for r in rows]}")
    expect(all(d.startswith(env.device.type) for d in devices), f"rank table devices {devices}")
    owners = all_gather_object((rows[env.rank]["host"], physical_device(env)))
    shared = len(set(owners)) < w
    expect(not shared or ctx.backend == "gloo", f"ranks share a device: {owners}")
    hosts = len({r["host"] for r in rows})
    table = " ".join(f"{r['rank']}:{d}" for r, d in zip(rows, devices))
    return f"{w} rank(s) on {hosts} host(s), sum exact; {table}" + ("; ranks share a GPU (gloo)" if shared else "")


def check_syncbn_conversion(ctx: Context) -> str:
    """MODEL.SYNCBN converts every BatchNorm of the model on CUDA."""
    needs_cuda(ctx)
    model = parallelize.build_model_for(make_cfg(ctx, "syncbn", "MODEL.SYNCBN", "True"), ctx.env)
    kinds = [type(m) for m in model.modules()]
    synced, plain = kinds.count(nn.SyncBatchNorm), kinds.count(nn.BatchNorm2d)
    expect(synced > 0 and plain == 0, f"{synced} SyncBatchNorm, {plain} BatchNorm2d left")
    expect(next(model.parameters()).device == ctx.env.device, "model is not on this rank's GPU")
    return f"resnet18: {synced} SyncBatchNorm layers, none left unconverted"


def check_syncbn_statistics(ctx: Context) -> str:
    """SyncBatchNorm in DDP, each rank on its slice, matches BatchNorm2d on the whole batch."""
    device, world, rank = needs_cuda(ctx), ctx.env.world_size, ctx.env.rank
    if world < 2:
        raise Skip("needs 2 or more ranks (torchrun --nproc_per_node=2 or more)")
    full = torch.randn(4 * world, 8, 6, 6, generator=torch.Generator().manual_seed(0)) * 3 + 2
    grad_out = torch.randn(full.shape, generator=torch.Generator().manual_seed(1)).to(device)
    full = full.to(device).requires_grad_()
    reference = nn.BatchNorm2d(8).to(device)
    expected = reference(full)
    (expected * grad_out).sum().backward()
    expected = expected.detach()
    mine = slice(4 * rank, 4 * rank + 4)
    part = full.detach()[mine].clone().requires_grad_()
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8))).to(device)
    ddp = nn.parallel.DistributedDataParallel(synced, device_ids=[device.index])
    out = ddp(part)
    (out * grad_out[mine]).sum().backward()
    bn = synced[0]
    expect_close("output", out, expected[mine])
    expect_close("running mean", bn.running_mean, reference.running_mean)
    expect_close("running var", bn.running_var, reference.running_var)
    expect_close("input gradient", part.grad, full.grad[mine])
    expect_close("weight gradient", bn.weight.grad * world, reference.weight.grad)  # DDP averages over ranks
    return f"{world} ranks x 4 samples: output, running mean/var, input and weight grads within rtol 1e-4, atol 1e-5"


def check_fp16_scaler(ctx: Context) -> str:
    """fp16 steps of the trainer: finite loss; an overflowing step is skipped; the scaler is saved."""
    run, batch = build_tiny_run(ctx, "fp16", "TRAIN.PRECISION", "fp16")
    losses = train_steps(run, batch, 3)
    expect(all(map(math.isfinite, losses)), f"non-finite fp16 loss: {losses}")
    run.scaler.update(2.0**40)  # the scaled gradients overflow fp16: the step must be skipped
    before = [p.detach().clone() for p in run.model.parameters()]
    train_steps(run, batch, 1)
    expect(all(torch.equal(a, p) for a, p in zip(before, run.model.parameters())), "an overflow step changed weights")
    scale = run.scaler.get_scale()
    expect(scale < 2.0**40, f"the scale did not back off after an overflow ({scale:g})")
    run.move_to(0, 4)  # as after 4 steps of epoch 1: what the checkpoint records
    path = save_training_checkpoint(run, checkpointer(run.cfg))
    if ctx.env.is_main_process:  # the one that wrote it
        state = ckpt.load_checkpoint(path)
        expect(state["scaler"] is not None and state["scaler"]["scale"] == scale, f"checkpoint holds {state['scaler']}")
        dtypes = {v.dtype for v in state["model"].values() if v.is_floating_point()}
        expect(dtypes == {torch.float32}, f"fp16 training saved weights of {dtypes}, not float32")
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; overflow at scale 2^40 skipped, now 2^{math.log2(scale):g}"


def check_bf16(ctx: Context) -> str:
    if ctx.env.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise Skip(f"{torch.cuda.get_device_name()} has no bf16")
    return loss_falls(ctx, "bf16", "TRAIN.PRECISION", "bf16")


def check_channels_last(ctx: Context) -> str:
    return loss_falls(ctx, "channels_last", "TRAIN.CHANNELS_LAST", "True")


def check_compile(ctx: Context) -> str:
    needs_cuda(ctx)
    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed (torch.compile's GPU code generator)")
    return loss_falls(ctx, "compile", "TRAIN.COMPILE", "True")


def check_pinned_copy(ctx: Context) -> str:
    """The training loader pins its uint8 batches; DeviceLoader copies them to the GPU without
    blocking and normalises them there, as build_normalize does on the CPU."""
    device = needs_cuda(ctx)
    cfg = make_cfg(ctx, "pinned", "TRAIN.PIN_MEMORY", "True", "TRAIN.WORKERS", "2")
    split = build_train_split(cfg, ctx.env)
    expect(split.loader.pin_memory, "the training loader does not pin memory on CUDA")
    images, targets, _ = next(iter(split.loader.loader))  # the DataLoader's own batch, before the copy
    expect(images.dtype == torch.uint8, f"the workers hand over {images.dtype}, not uint8")
    expect(images.is_pinned() and targets.is_pinned(), "the batch is not in pinned memory")
    on_gpu, targets_again, _ = next(iter(split.loader))  # the same first batch: seeded per sample
    expect(on_gpu.device == device and on_gpu.dtype == torch.float32, f"the batch is {on_gpu.dtype} on {on_gpu.device}")
    on_cpu = build_normalize(cfg)(images)
    expect(torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5), "normalised on the GPU, the batch differs from the CPU's")
    expect(torch.equal(targets_again.cpu(), targets), "targets differ")
    return f"uint8 batch {tuple(images.shape)} pinned; copied and normalised on the GPU as on the CPU"


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


def check_nvjpeg(ctx: Context) -> str:
    """DATA.DECODER batched decodes each batch with nvJPEG on the GPU, close to the CPU decode."""
    device = needs_cuda(ctx)
    root = jpeg_tree(os.path.join(ctx.work_dir, f"jpeg_rank{ctx.env.rank}"))
    opts = ["TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.DECODER", "batched", "TEST.BATCH_SIZE", "16"]
    on_cpu = list(build_val_split(make_cfg(ctx, "nvjpeg", *opts, "TRAIN.WORKERS", "0"), DistEnv()).loader)
    split = build_val_split(make_cfg(ctx, "nvjpeg", *opts, "TRAIN.WORKERS", "2"), DistEnv(device=device))
    on_gpu = list(split.loader)
    expect(split.loader.pin_memory and len(on_gpu) == len(on_cpu), "no pinned memory, or another batch count")
    # nvJPEG and libjpeg-turbo may round differently: close, not bit for bit.
    worst = 0.0
    for (images_gpu, targets_gpu, _), (images_cpu, targets_cpu, _) in zip(on_gpu, on_cpu):
        expect(images_gpu.device == device and images_gpu.shape == images_cpu.shape, "batch not on the GPU")
        expect(torch.equal(targets_gpu.cpu(), targets_cpu), "targets differ")
        worst = max(worst, (images_gpu.cpu() - images_cpu).abs().mean().item())
    expect(worst < 0.05, f"mean |GPU - CPU| of a batch is {worst:.4f} >= 0.05")
    train_cfg = make_cfg(ctx, "nvjpeg", *opts, "TRAIN.WORKERS", "2", "DATA.AUTO_AUGMENT", "trivialaugment")
    images, _, _ = next(iter(build_train_split(train_cfg, DistEnv(device=device)).loader))
    shape = (32, 3, 16, 16)
    expect(images.device == device and images.shape == shape, f"augmented batch {images.shape} on {images.device}")
    expect(bool(torch.isfinite(images).all()), "the augmented batch on the GPU is not finite")
    return f"{len(on_gpu)} val batches: worst mean |GPU - CPU| {worst:.4f} (< 0.05); augmented train batch ok"


def check_no_host_sync(ctx: Context) -> str:
    """A training window (data, forward, backward, step, metrics) never waits for the GPU: fp32,
    bf16, fp16 (GradScaler); with the batched decoder's loader feeding it, at most once a batch
    (a decoder may sync the stream before nvJPEG writes into memory queued kernels still read)."""
    cuda = ctx.env.device.type == "cuda"
    if cuda and ctx.backend == "gloo" and ctx.env.world_size > 1:
        # A raising sync inside gloo's collective fails one rank there and leaves the other waiting.
        raise Skip("gloo copies CUDA tensors through the host, so every gradient all-reduce syncs: run it over NCCL")
    precisions = ["fp32", "fp16"] + (["bf16"] if not cuda or torch.cuda.is_bf16_supported() else [])
    for precision in precisions:
        window_without_sync(ctx, f"sync_{precision}", "TRAIN.PRECISION", precision)
    window_without_sync(ctx, "sync_batched", *jpeg_dataset(ctx), syncs_per_step=1)
    if not cuda:
        raise Skip("no CUDA: the windows trained on the CPU, where host syncs are not watched")
    return f"3 steps each without a host sync: {', '.join(precisions)}; batched decoder <= 1 a batch"


def augment_syncs(ctx: Context, name: str, *augment: str, batches: int = 3) -> tuple[int, int]:
    """Host syncs while the batched decoder's loader decodes and augments ``batches`` batches; and the images."""
    loader = iter(build_train_split(make_cfg(ctx, name, *jpeg_dataset(ctx), *augment), ctx.env).loader)
    next(loader)  # workers start, nvJPEG initialises
    with counting_host_syncs(ctx.env.device) as syncs:
        images = [next(loader)[0] for _ in range(batches)]
    expect(all(bool(torch.isfinite(x).all()) for x in images), f"a batch augmented by {augment} is not finite")
    return len(syncs), sum(len(x) for x in images)


def check_augment_no_host_sync(ctx: Context) -> str:
    """No per-sample host sync in the batched decoder's GPU augmentation: RandomErasing adds none
    to the decode's one a batch at most. TrivialAugment's are counted: torchvision builds its
    geometric ops' matrices from host values per sample (docs/gpu.md)."""
    erasing, images = augment_syncs(ctx, "erasing_sync", "DATA.RANDOM_ERASING", "0.5")
    trivial, _ = augment_syncs(ctx, "trivial_sync", "DATA.AUTO_AUGMENT", "trivialaugment")
    if ctx.env.device.type != "cuda":
        raise Skip("no CUDA: the batches were augmented on the CPU, where host syncs are not watched")
    expect(erasing <= 3, f"RandomErasing: {erasing} host syncs in 3 batches ({images} images): per sample")
    return f"RandomErasing: {erasing} syncs in 3 batches; TrivialAugment: {trivial} ({trivial / images:.1f} a sample)"


def check_nvjpeg_ran(ctx: Context) -> str:
    """nvJPEG really decoded the JPEGs of a batched decode, rather than the CPU fallback."""
    needs_cuda(ctx)
    stats = getattr(batched, "decode_stats", None)
    if stats is None:
        raise Skip("unknown: this version's data/batched.py keeps no decode_stats")
    stats.reset()
    cfg = make_cfg(ctx, "nvjpeg_ran", *jpeg_dataset(ctx), "TRAIN.WORKERS", "2")
    batches = sum(1 for _ in build_val_split(cfg, ctx.env).loader)
    gpu, cpu = getattr(stats, "gpu_images", 0), getattr(stats, "cpu_fallback_images", 0)
    expect(gpu > 0, f"nvJPEG decoded no image of {batches} batches: {cpu} fell back to the CPU decoder")
    return f"{batches} val batches: nvJPEG decoded {gpu} images, {cpu} fell back to the CPU"


def check_fsdp_sharded_checkpoint(ctx: Context) -> str:
    """fsdp trains on the run's device; a sharded (DCP) checkpoint loads back into a fresh model exactly.

    On one rank, as on a one-GPU machine, fsdp trains the plain model (nothing to shard) and still
    writes and reads its checkpoints as DCP folders: that path is checked on the device."""
    opts = ("DIST.STRATEGY", "fsdp", "DIST.CKPT_FORMAT", "sharded")
    run, batch = build_tiny_run(ctx, "fsdp_dcp", *opts)
    sharded = ctx.env.world_size > 1
    devices = {p.to_local().device if sharded else p.device for p in run.model.parameters()}
    expect(devices == {ctx.env.device}, f"parameters on {devices}, not {ctx.env.device}")
    expect(
        sharded == all(isinstance(p, DTensor) for p in run.model.parameters()), "sharded on one rank, or not on several"
    )
    losses = train_steps(run, batch, 4)
    expect(all(map(math.isfinite, losses)) and losses[-1] < losses[0], f"loss did not fall under fsdp: {losses}")
    run.move_to(0, 4)  # as after 4 steps of epoch 1: what the checkpoint records
    path = save_training_checkpoint(run, checkpointer(run.cfg))
    expect(path.endswith(".dcp"), f"DIST.CKPT_FORMAT sharded wrote {path}, not a DCP folder")
    trained = full_weights(run.model)
    fresh, _ = build_tiny_run(ctx, "fsdp_dcp", *opts)  # seeded alike: the untrained weights
    resume_or_load_weights(fresh, checkpointer(fresh.cfg), path)
    loaded = full_weights(fresh.model)
    differ = [k for k in trained if not torch.equal(trained[k], loaded[k])]
    expect(not differ, f"{len(differ)} of {len(trained)} tensors differ after the DCP load, e.g. {differ[:2]}")
    expect(fresh.state.step_in_epoch == 4, f"resumed at step {fresh.state.step_in_epoch}, not 4")
    where = f"sharded over {ctx.env.world_size} ranks" if sharded else "of the plain model (1 rank: nothing to shard)"
    return f"{len(trained)} tensors {where}; DCP save and load exact"


def check_sharded_scaler_fp16(ctx: Context) -> str:
    """fsdp with fp16 parameters: ShardedGradScaler steps, skips an overflow on every rank, backs off."""
    if ctx.env.world_size < 2:
        raise Skip("1 rank trains the plain model with GradScaler (the fp16 row): 2+ ranks shard")
    run, batch = build_tiny_run(
        ctx, "fsdp_fp16", "DIST.STRATEGY", "fsdp", "TRAIN.PRECISION", "fp16", "MODEL.ARCH", TINY_NO_BN
    )
    expect(isinstance(run.scaler, ShardedGradScaler), f"the scaler is a {type(run.scaler).__name__}")
    conv = next(m for m in run.model.modules() if isinstance(m, nn.Conv2d))
    dtypes: set = set()
    hook = conv.register_forward_pre_hook(lambda module, args: dtypes.add(module.weight.dtype))
    losses = train_steps(run, batch, 3)
    hook.remove()
    expect(dtypes == {torch.float16}, f"parameters in forward are {dtypes}, not float16")
    expect(all(map(math.isfinite, losses)), f"non-finite fp16 loss: {losses}")
    run.scaler.update(2.0**40)  # the scaled gradients overflow fp16: every rank must skip the step
    before = full_weights(run.model)
    train_steps(run, batch, 1)
    after = full_weights(run.model)
    expect(all(torch.equal(before[k], after[k]) for k in before), "an overflow step changed the weights")
    scale = run.scaler.get_scale()
    expect(scale < 2.0**40, f"the scale did not back off after an overflow ({scale:g})")
    return f"fp16 parameters in forward; loss {losses[0]:.3f} -> {losses[-1]:.3f}; overflow skipped, scale 2^{math.log2(scale):g}"


def check_resume(ctx: Context) -> str:
    """Two epochs straight equal one epoch, a stop, and a resume: every checkpointed tensor."""
    runs = ("straight", "resumed")
    # resnet18 for cuDNN's kernels on the GPU; the tiny model keeps the CPU variant to seconds.
    # With several ranks on CUDA, SyncBatchNorm trains end to end here too (over gloo as well:
    # torch 2.11's gloo carries its CUDA all_gather and all_reduce, docs/gpu.md).
    cuda = ctx.env.device.type == "cuda"
    arch = "resnet18" if cuda else TINY
    opts = ["MODEL.ARCH", arch, "MODEL.SYNCBN", str(cuda), "OPTIM.MAX_EPOCH", "2"]
    opts += ["CUDNN.DETERMINISTIC", "True", "CUDNN.BENCHMARK", "False"]
    # In this job's process group, which train_model keeps for the next check.
    trainer.train_model(make_cfg(ctx, runs[0], *opts), cleanup=False)
    trainer.train_model(make_cfg(ctx, runs[1], *opts, "TRAIN.STOP_AFTER_EPOCHS", "1"), cleanup=False)
    trainer.train_model(make_cfg(ctx, runs[1], *opts), cleanup=False)  # TRAIN.AUTO_RESUME is on by default
    if not ctx.env.is_main_process:
        return ""
    a, b = (ckpt.load_checkpoint(os.path.join(ctx.work_dir, d, ckpt.CKPT_DIR, ckpt.checkpoint_name(2))) for d in runs)
    if ckpt.state_checksum(a) != ckpt.state_checksum(b):  # SHA-256 over every model and optimizer tensor
        differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
        raise CheckFailed(f"checkpoints differ: {len(differ)} of {len(a['model'])} model tensors, e.g. {differ[:2]}")
    with_syncbn = ", SyncBatchNorm" if cuda and ctx.env.world_size > 1 else ""
    return f"{arch}{with_syncbn}, 2 epochs: the {len(a['model'])} model tensors and the optimizer state identical"


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


def check_prefetch_memory(ctx: Context) -> str:
    """Six passes of the prepare thread leave ``memory_reserved`` where the second left it: each pass
    reuses the blocks the last freed, on the one side stream (a stream a pass would strand them)."""
    reserved = batched_val_passes(ctx, "reserved", 6)
    needs_cuda(ctx)
    mib = [round(r / 2**20, 1) for r in reserved]
    expect(reserved[-1] <= reserved[1], f"memory_reserved grew pass after pass (MiB): {mib}")
    return f"memory_reserved after each of 6 passes (MiB): {mib}"


def check_one_context_per_rank(ctx: Context) -> str:
    """After prefetch passes (the batched checks above ran them), this process holds a CUDA context
    on its own GPU alone: the prepare thread sets its device before it touches a stream."""
    device = needs_cuda(ctx)
    if torch.cuda.device_count() < 2:
        raise Skip("one GPU visible to this process: no other GPU to find a context on")
    batched_val_passes(ctx, "contexts", 1, "TRAIN.WORKERS", "2")
    contexts = primary_contexts()
    expect(contexts == {device.index}, f"CUDA contexts on GPUs {sorted(contexts)}; this rank's GPU is {device.index}")
    return f"a context on GPU {device.index} alone of {torch.cuda.device_count()} visible"


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


def check_side_stream_not_nccls(ctx: Context) -> str:
    """The prepare thread's kernels never run on one of NCCL's streams, over 40 passes (more than the
    32 streams of a pool): its one side stream is a high-priority one, NCCL's come from the others."""
    device = needs_cuda(ctx)
    if ctx.backend != "nccl":
        raise Skip(f"the process group is {ctx.backend or 'none'}: no NCCL stream to compare with")
    threads: set[int] = set()
    decode = batched.BatchDecoder.prepare

    def noting_thread(self, batch):
        threads.add(threading.get_native_id())
        return decode(self, batch)

    batched.BatchDecoder.prepare = noting_thread
    try:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            batched_val_passes(ctx, "nccl_stream", 40, each=lambda batch: all_reduce_sum(batch[0].sum()[None]))
    finally:
        batched.BatchDecoder.prepare = decode
    path = os.path.join(ctx.work_dir, f"nccl_stream_rank{ctx.env.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    expect(len(threads) == 1, f"batches prepared on {len(threads)} threads, not one")
    mine, nccl = kernel_streams(events, threads.pop())
    if not nccl or not mine:
        raise Skip(f"the trace shows {'no NCCL kernel' if not nccl else 'no kernel of the prepare thread'} on {device}")
    expect(not mine & nccl, f"the prepare thread ran kernels on NCCL's stream(s) {sorted(mine & nccl)}")
    return f"40 passes: the prepare thread's stream(s) {sorted(mine)}, NCCL's {sorted(nccl)}"


CHECKS = [
    ("all-reduce + rank table", check_all_reduce),
    ("SyncBatchNorm conversion", check_syncbn_conversion),
    ("SyncBatchNorm = full-batch BN", check_syncbn_statistics),
    ("fp16 + GradScaler", check_fp16_scaler),
    ("bf16 autocast", check_bf16),
    ("channels_last", check_channels_last),
    ("torch.compile", check_compile),
    ("pinned memory, non_blocking", check_pinned_copy),
    ("batched nvJPEG decode", check_nvjpeg),
    ("nvJPEG ran (decode_stats)", check_nvjpeg_ran),
    ("no host sync in training", check_no_host_sync),
    ("no host sync in GPU augment", check_augment_no_host_sync),
    ("prefetch memory flat, 6 passes", check_prefetch_memory),
    ("one CUDA context per rank", check_one_context_per_rank),
    ("side stream is not NCCL's", check_side_stream_not_nccls),
    ("fsdp + sharded checkpoint", check_fsdp_sharded_checkpoint),
    ("fsdp fp16 ShardedGradScaler", check_sharded_scaler_fp16),
    ("resume bit-identical", check_resume),
]


def describe(env: DistEnv, backend: str) -> str:
    where = f"{env.world_size} rank(s) on {env.device.type}" + (f" ({backend})" if backend else "")
    where += f", torch {torch.__version__}"
    if env.device.type == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple on current PyTorch, an int on old ones
        where += f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"
        where += f", {torch.cuda.get_device_name(env.device)}"
    return where


def check_work_dir(work_dir: str, launch: DistEnv) -> None:
    """Refuse several nodes without --work-dir: rank 0's temporary folder is not on the other nodes.

    Their ranks would not find the resume check's checkpoint and leave the collectives, the others
    waiting on them until the timeout. Every rank decides alike from its launcher's variables,
    before any collective, so all of them exit.
    """
    if launch.world_size > launch.local_world_size and not work_dir:
        raise LaunchError(
            f"{launch.world_size} ranks on several nodes ({launch.local_world_size} on this one) need "
            "--work-dir DIR on a filesystem every node shares (the default temporary folder is rank 0's alone)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, CUDA checks skip")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: ranks may share a GPU (with --device cuda)"
    )
    parser.add_argument("--work-dir", default="", help="keep the trainer runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is first touched: the trainer's device is the CPU
    elif not torch.cuda.is_available():
        if detect_env_rank() == 0:
            print(
                "gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check", file=sys.stderr
            )
        return EXIT_NOTHING_TO_CHECK
    try:
        check_work_dir(args.work_dir, detect_env())
        env = setup_distributed("gloo" if args.device == "cpu" else args.backend, timeout_s=300)
    except (LaunchError, ValueError) as e:
        if detect_env_rank() == 0:
            print(f"gpu_check: error: {first_line(e)}", file=sys.stderr)
        return EXIT_NOTHING_TO_CHECK
    work_dir = broadcast_object(
        args.work_dir or (tempfile.mkdtemp(prefix="gpu_check_") if env.is_main_process else None)
    )
    say = (lambda line: print(line, flush=True)) if env.is_main_process else (lambda line: None)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else ""
    say(f"gpu_check: {describe(env, backend)}")
    try:
        results = run_checks(CHECKS, Context(env, work_dir, backend), say)
        failed, skipped = (sum(r.status == s for r in results) for s in ("FAIL", "SKIP"))
        say(f"gpu_check: {len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped")
        barrier()  # every rank is done with the work folder before rank 0 removes it
        return exit_code(results)
    except (KeyboardInterrupt, Preempted) as e:  # every rank stops; no barrier: they stopped in different places
        code = getattr(e, "exit_code", EXIT_INTERRUPTED)
        if env.is_main_process:
            why = "Ctrl-C" if code == EXIT_INTERRUPTED else first_line(e)
            print(f"gpu_check: stopped ({why}); exiting with {code}", file=sys.stderr, flush=True)
        return code
    finally:
        if env.is_main_process and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
