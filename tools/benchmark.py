"""Measure training, evaluation and data-pipeline speed; compare the trainer with a hand-written DDP loop.

Runs under the same launchers as training and reads the same config::

    python tools/benchmark.py [--steps 30 --repeats 5 --what train,plain] [--cfg FILE] [KEY VALUE ...]
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 tools/benchmark.py MODEL.ARCH resnet18 TRAIN.BATCH_SIZE 64
    srun python tools/benchmark.py --cfg FILE

Rank 0 prints one JSON object per line per measurement (also appended to ``--json PATH``) and a
table at the end. Training (``train``) is what a user's run does: epochs of the configured dataset
through the trainer's public ``train_one_epoch`` (its DataLoader, sync points and epoch boundary),
alternating with a minimal hand-written DDP loop (``plain``: same model, initial weights, batch,
optimizer and parameter groups, dataset and transforms, DataLoader workers, world size) so drift
hits both alike. The other measurements run on MODEL.DUMMY_INPUT data (in memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from yacs.config import CfgNode  # noqa: E402

from distribuuuu import trainer  # noqa: E402
from distribuuuu.cli import parse_args  # noqa: E402
from distribuuuu.config import ConfigError, load_cfg  # noqa: E402
from distribuuuu.data import DataError, jpeg, load_image  # noqa: E402
from distribuuuu.errors import EXIT_INTERRUPTED, first_line  # noqa: E402
from distribuuuu.records.meters import MetricSums  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv, LaunchError, RankLaunchError, detect_env_rank  # noqa: E402
from distribuuuu.runtime.parallel import autocast, gradient_sync, local_state_bytes, to_device  # noqa: E402
from distribuuuu.runtime.process_group import (  # noqa: E402
    all_reduce_sum,
    barrier,
    broadcast_object,
    cleanup_distributed,
    setup_distributed,
)
from distribuuuu.training import run as run_setup  # noqa: E402
from distribuuuu.training.evaluation import validate  # noqa: E402
from distribuuuu.training.inputs import build_train_split  # noqa: E402
from distribuuuu.training.optim import LAMB, LARS, freeze, lr_at, optimizer_groups, set_lr  # noqa: E402
from distribuuuu.training.parallelize import build_configured_model  # noqa: E402
from distribuuuu.training.preprocessing import (
    build_normalize,  # noqa: E402
    build_train_transform,  # noqa: E402
)
from distribuuuu.training.rng import seed_everything  # noqa: E402
from distribuuuu.training.session import Session  # noqa: E402
from distribuuuu.training.state import Run, global_batch  # noqa: E402

WHAT = ("train", "plain", "breakdown", "data", "decode", "eval", "variants", "memory", "packed", "index")
DEFAULT_WHAT = "train,plain,breakdown,data,decode,eval"
PHOTO_SIZE = (500, 375)  # width, height: a typical ImageNet photo
# --what packed: ImageNet-like mixed sizes (width, height), drawn with these weights.
MIXED_SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (640, 480), (800, 600), (1024, 768), (400, 300))
MIXED_WEIGHTS = (0.3, 0.15, 0.15, 0.1, 0.1, 0.08, 0.04, 0.08)
REENCODE = (320, 90)  # --what packed's re-encoded variant: longer side <= 320 px, JPEG quality 90
DECODE_BATCH = 32  # JPEGs per decode_jpeg call when timing DATA.DECODER "batched" alone
SYNTHETIC_STEPS = 30  # steps per repetition of the synthetic measurements when --steps is 0
_LAUNCHER_FLAGS = ("--local_rank", "--local-rank")  # torch.distributed.launch's, passed to cli.parse_args


# ------------------------------------------------------------------------------------------------
# Arguments, config, output
# ------------------------------------------------------------------------------------------------
def parse_bench_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """Split the benchmark's own flags from the training tools' ``--cfg FILE KEY VALUE ...``."""
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=0,
        help="train/plain: the last N steps of each timed epoch (0: whole epochs, as a run trains);\n"
        "the synthetic measurements: steps per repetition (0: 30)",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before measuring each implementation")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (median and spread reported)")
    p.add_argument("--what", default=DEFAULT_WHAT, help=f"comma-separated subset of {','.join(WHAT)}")
    p.add_argument("--workers", type=counts(0), default="0,1,2", help="DataLoader worker counts for --what data")
    p.add_argument(
        "--data-batches", type=int, default=20,
        help="batches timed per data-pipeline measurement, after the workers' queue (whole rounds of the workers)",
    )  # fmt: skip
    p.add_argument("--photos", type=int, default=96, help="synthetic JPEGs generated for --what decode / packed")
    p.add_argument("--bf16-steps", type=int, default=3, help="timed steps of the bf16 variants (slow on CPUs)")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    p.add_argument(
        "--memory-table", type=counts(1), default="", metavar="WORLD_SIZES",
        help="driver: for each world size (e.g. 1,2,4), model (--archs) and strategy (ddp, ddp+ZeRO-1, fsdp)\n"
        "start one torchrun job of --what memory, then print the per-rank bytes table with img/s vs ddp",
    )  # fmt: skip
    p.add_argument(
        "--archs", default="resnet18", help="--memory-table: comma-separated MODEL.ARCH[:KWARG=VALUE...] values"
    )
    p.add_argument("--index-folder", default="", help="--what index: this split folder (default: make ImageNet's)")
    p.add_argument("--index-entries", type=int, default=1_281_167, help="--what index: files of the folder it makes")
    p.add_argument(
        "--index-ranks", type=counts(1), default="2,4", help="--what index: local rank counts whose start-up is timed"
    )
    p.add_argument("--cfg", dest="cfg_file", default=None, help="YAML config file, as train_net.py's")
    p.usage = p.format_usage().removeprefix("usage: ").rstrip() + " [KEY VALUE ...]"
    bench, rest = p.parse_known_args(argv)
    # What is left is the config's KEY VALUE pairs: any other flag is refused here, with this
    # usage (cli.parse_args' would name flags of the training tools, --nproc, that this one lacks).
    unknown = [a for a in rest if a.startswith("--") and a.split("=", 1)[0] not in _LAUNCHER_FLAGS]
    if unknown:
        hint = "; start several processes with torchrun --nproc_per_node=N" if "--nproc" in unknown else ""
        p.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    what = [w for w in bench.what.split(",") if w]
    unknown = [w for w in what if w not in WHAT]
    if unknown or min(bench.repeats, bench.data_batches, bench.bf16_steps) < 1 or min(bench.warmup, bench.steps) < 0:
        p.error(f"--what must name items of {WHAT} (got {unknown}); --repeats, ... must be >= 1, --steps >= 0")
    bench.what = what
    return bench, parse_args([*(["--cfg", bench.cfg_file] if bench.cfg_file else []), *rest], __doc__)


def counts(minimum: int) -> Callable[[str], list[int]]:
    """argparse's type for a comma-separated list of whole numbers >= ``minimum`` ("0,1,2")."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = [minimum - 1]
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= {minimum}, got {text!r}")
        return values

    return parse


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


# ------------------------------------------------------------------------------------------------
# Training: the trainer's own loop and a hand-written one
# ------------------------------------------------------------------------------------------------
def framework_epoch(run: Run, steps: int, epoch: int) -> None:
    """An epoch of train_net.py (its last ``steps`` steps; 0: all) through the trainer's public
    ``train_one_epoch``: the DataLoader's start, the sync points, the epoch boundary."""
    steps = min(steps or run.steps_per_epoch, run.steps_per_epoch)
    run.move_to(epoch % run.cfg.OPTIM.MAX_EPOCH, run.steps_per_epoch - steps)
    trainer.train_one_epoch(run, Session(run.cfg, env=run.env), run.state.epoch)


class PlainLoop:
    """A minimal hand-written DDP training loop, as a tutorial would write it.

    Same model and initial weights, batch, optimizer class, hyper-parameters and parameter groups
    (no weight decay on biases and norm weights) as the run; the same images and training
    transforms (normalised in the workers), read by a plain DataLoader with DistributedSampler
    and the run's worker count; DDP with its default knobs, a constant LR and no metrics. What
    the trainer adds (LR schedule, metrics, sync points, epoch boundary, EMA, mixup, NaN checks,
    its resumable sampler and device-side normalisation) is counted as the trainer's cost.
    """

    def __init__(self, run: Run):
        cfg, env = run.cfg, run.env
        self.cfg, self.env = cfg, env
        model = build_configured_model(cfg.MODEL).to(env.device)
        model.load_state_dict(run.model.state_dict())
        freeze(model, cfg.MODEL.FREEZE)
        if cfg.TRAIN.CHANNELS_LAST:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        if env.world_size > 1:
            ids = [env.device.index] if env.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.optimizer = self._optimizer(model, cfg, run.base_lr)
        data = plain_dataset(run)
        t, workers = cfg.TRAIN, cfg.TRAIN.WORKERS
        sampler = torch.utils.data.DistributedSampler(data, env.world_size, env.rank, seed=cfg.RNG_SEED)
        self.sampler = sampler
        self.loader = torch.utils.data.DataLoader(
            data, t.BATCH_SIZE, sampler=sampler, drop_last=True, num_workers=workers,
            pin_memory=t.PIN_MEMORY and env.device.type == "cuda", persistent_workers=workers > 0 and t.PERSISTENT_WORKERS,
        )  # fmt: skip
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.TRAIN.PRECISION)
        self.normalize = build_normalize(cfg)  # synthetic uint8 images, normalised on the device as the trainer does

    @staticmethod
    def _optimizer(model: nn.Module, cfg: CfgNode, lr: float) -> torch.optim.Optimizer:
        o = cfg.OPTIM
        # The run's own groups (decay split, head multiplier, layer decay), each at its LR scale:
        # the plain loop keeps a constant LR, so the scale is applied once here.
        groups = optimizer_groups(model, o)
        for group in groups:
            group["lr"] = lr * group["lr_scale"]
        if o.OPTIMIZER == "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=tuple(o.BETAS))
        if o.OPTIMIZER == "lars":  # PyTorch has no LARS nor LAMB: the framework's classes are the only ones
            return LARS(groups, lr=lr, momentum=o.MOMENTUM, trust=o.LARS_TRUST)
        if o.OPTIMIZER == "lamb":
            return LAMB(groups, lr=lr, betas=tuple(o.BETAS))
        return torch.optim.SGD(groups, lr=lr, momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV)

    def run_steps(self, steps: int, epoch: int) -> None:
        """Train ``steps`` optimizer steps of an epoch (0: the whole epoch)."""
        t, device = self.cfg.TRAIN, self.env.device
        self.model.train()
        self.sampler.set_epoch(epoch)
        batches = iter(self.loader)
        for _ in range(min(steps or len(self.loader) // t.ACCUM_STEPS, len(self.loader) // t.ACCUM_STEPS)):
            for i in range(t.ACCUM_STEPS):
                images, targets = next(batches)
                images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                if images.dtype == torch.uint8:
                    images = self.normalize(images)
                if t.CHANNELS_LAST:
                    images = images.contiguous(memory_format=torch.channels_last)
                last = i == t.ACCUM_STEPS - 1
                no_sync = self.model.no_sync() if not last and self.env.world_size > 1 else contextlib.nullcontext()
                with no_sync, torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype is not None):
                    out = self.model(images)
                    loss = nn.functional.cross_entropy(out.float(), targets, label_smoothing=t.LABEL_SMOOTHING)
                (loss / t.ACCUM_STEPS).backward()
            if t.CLIP_GRAD_NORM > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), t.CLIP_GRAD_NORM)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class _Transformed(torch.utils.data.Dataset):
    """(image, target) pairs of a base dataset through a transform: torchvision's ImageFolder(transform=...)."""

    def __init__(self, base, transform):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, target = self.base[index]
        return self.transform(image), target


def plain_dataset(run: Run) -> torch.utils.data.Dataset:
    """The run's training images for the plain loop: the synthetic uint8 tensors as they are
    (normalised on the device), else the same decoded images through the same training
    transforms, normalised (as a tutorial's loader does)."""
    base = run.train.dataset.base
    if run.cfg.MODEL.DUMMY_INPUT:
        return torch.utils.data.TensorDataset(base.images, base.targets)  # the very tensors the trainer reads
    return _Transformed(base, build_train_transform(run.cfg, normalize=True))


def build_bench_run(cfg: CfgNode, env: DistEnv) -> Run:
    """A Run exactly as train_model builds it (no checkpoint, no OUT_DIR)."""
    seed_everything(cfg.RNG_SEED + env.rank)
    return run_setup.build_run(cfg, env)


def measure_training(run: Run, bench, report: Report, with_framework: bool, with_plain: bool) -> None:
    """Time framework and plain repetitions alternately (ABBA order); report both and their ratio."""
    cfg, env = run.cfg, run.env
    steps = min(bench.steps or run.steps_per_epoch, run.steps_per_epoch)
    plain = PlainLoop(run) if with_plain else None
    impls: dict[str, Callable[[int], None]] = {}
    if with_framework:
        impls["framework"] = lambda r, n=steps: framework_epoch(run, n, r)
    if plain is not None:
        impls["plain"] = lambda r, n=steps: plain.run_steps(n, r)
    # The warm-up's seconds hold TRAIN.COMPILE's compile (and cuDNN's autotuning): reported, not in the rates.
    warmup_s: dict[str, float] = {}
    if bench.warmup:
        if with_framework:
            warmup_s["framework"] = timed(lambda: framework_epoch(run, min(bench.warmup, steps), 0), env)
        if plain is not None:
            warmup_s["plain"] = timed(lambda: plain.run_steps(min(bench.warmup, steps), 0), env)
    seconds: dict[str, list[float]] = {name: [] for name in impls}
    peak_mib = dict.fromkeys(impls, 0.0)
    for r in range(bench.repeats):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        for name in order:
            reset_peak_memory(env)
            seconds[name].append(timed(partial(impls[name], r + 1), env))
            peak_mib[name] = max(peak_mib[name], peak_memory_mib(env))
    images = steps * global_batch(cfg.TRAIN, env.world_size)
    rates = {}
    for name, secs in seconds.items():
        rates[name] = [images / s for s in secs]
        report.emit(
            {
                "what": "train",
                "impl": name,
                **describe(cfg, env),
                "dataset": "synthetic" if cfg.MODEL.DUMMY_INPUT else cfg.TRAIN.DATASET,
                "steps": steps,
                "repeats": bench.repeats,
                **spread(rates[name], "images_per_s"),
                "images_per_s_per_proc": statistics.median(rates[name]) / env.world_size,
                **spread([1000 * s / steps for s in secs], "ms_per_step"),
                # On the CPU both implementations share one process, so its peak RSS covers both.
                "peak_mem_mib": peak_mib[name],
                "peak_mem_kind": "cuda_allocated" if env.device.type == "cuda" else "process_rss",
                "warmup_steps": min(bench.warmup, steps),
                "warmup_s": warmup_s.get(name, 0.0),
            }
        )
    if "framework" in rates and "plain" in rates:
        pairs = [f / p for f, p in zip(rates["framework"], rates["plain"])]
        report.emit(
            {
                "what": "ratio",
                **describe(cfg, env),
                "framework_over_plain": statistics.median(rates["framework"]) / statistics.median(rates["plain"]),
                **spread(pairs, "paired_ratio"),
            }
        )


def measure_breakdown(run: Run, env: DistEnv, bench, report: Report) -> None:
    """Time the parts of a trainer step: data wait, forward+backward, exposed all-reduce, optimizer step.

    Each part starts after a barrier, so a slow rank's delay is not charged to the next part. The
    all-reduce is the backward with DDP's gradient sync minus the same backward under no_sync:
    DDP overlaps communication with backward, so this is its exposed, not total, cost.
    """
    cfg = run.cfg
    run.forward_model.train()
    run.move_to(0, 0)
    trainer.start_epoch_sampler(run, 0)
    batches = iter(run.train.loader)
    sums = MetricSums(env.device, cfg.TRAIN.TOPK)
    parts: dict[str, list[float]] = {
        k: [] for k in ("data", "fwd_bwd", "fwd_bwd_allreduce", "optimizer", "bookkeeping", "teacher")
    }
    steps = min(bench.steps or SYNTHETIC_STEPS, run.steps_per_epoch)
    for i in range(steps):
        tic = time.perf_counter()
        images, targets, _ = next(batches)
        images, targets = to_device(images, targets, env, cfg.TRAIN.CHANNELS_LAST)
        sync_device(env)
        data_s = time.perf_counter() - tic
        out: dict = {}
        teacher = timed(partial(_teacher_forward, run, images, out), env) if run.teacher is not None else 0.0
        fb = [timed(partial(_forward_backward, run, images, targets, sync, out), env) for sync in (False, True)]
        bookkeeping = timed(partial(_bookkeeping, run, sums, out, targets), env)
        opt = timed(partial(trainer.optimizer_step, run, sums), env)
        if i >= min(bench.warmup, steps - 1):
            for key, value in zip(parts, (data_s, fb[0], fb[1], opt, bookkeeping, teacher)):
                parts[key].append(1000 * value)
    med = {k: statistics.median(v) for k, v in parts.items()}
    report.emit(
        {
            "what": "breakdown",
            **describe(cfg, env),
            "steps": len(parts["data"]),
            "data_ms": med["data"],
            "fwd_bwd_ms": med["fwd_bwd"],
            "allreduce_exposed_ms": med["fwd_bwd_allreduce"] - med["fwd_bwd"],
            "optimizer_ms": med["optimizer"],
            "bookkeeping_ms": med["bookkeeping"],
            # DISTILL.TEACHER: its forward on the step's images (no gradients, the student's autocast)
            "teacher_ms": med["teacher"] if run.teacher is not None else None,
            "teacher_arch": run.teacher.identity["arch"] if run.teacher is not None else None,
            "ddp": isinstance(run.forward_model, nn.parallel.DistributedDataParallel),
        }
    )


def _forward_backward(run: Run, images: torch.Tensor, targets: torch.Tensor, sync: bool, out: dict) -> None:
    """One forward and backward through the trainer's model, with or without DDP's gradient all-reduce."""
    run.optimizer.zero_grad(set_to_none=True)
    teacher = [out["teacher_logits"]] if run.teacher is not None else []  # timed apart: _teacher_forward
    with gradient_sync(run.forward_model, sync), autocast(run.cfg.TRAIN.PRECISION, run.env.device):
        logits = run.forward_model(images)
        loss = run.criterion(logits.float(), targets, *teacher)
    loss.backward()
    out.update(logits=logits.detach(), loss=loss.detach())


def _teacher_forward(run: Run, images: torch.Tensor, out: dict) -> None:
    """DISTILL.TEACHER's forward as the trainer's step runs it: under the student's autocast, no gradients."""
    with autocast(run.cfg.TRAIN.PRECISION, run.env.device):
        out["teacher_logits"] = run.teacher(images).float()


def _bookkeeping(run: Run, sums: MetricSums, out: dict, targets: torch.Tensor) -> None:
    """What train_epoch does per step besides compute: the LR schedule and the metric sums."""
    set_lr(run.optimizer, lr_at(run.global_step, run.steps_per_epoch, run.cfg.OPTIM, run.base_lr))
    sums.add(out["loss"], out["logits"], targets)


def measure_variants(cfg_args, env: DistEnv, bench, report: Report) -> None:
    """Trainer throughput with channels_last and bf16 each on and off (bf16: few steps, one repeat)."""
    for precision in ("fp32", "bf16"):
        for channels_last in (False, True):
            slow = precision == "bf16" and env.device.type == "cpu"
            steps = bench.bf16_steps if slow else bench.steps or SYNTHETIC_STEPS
            extra = ("TRAIN.PRECISION", precision, "TRAIN.CHANNELS_LAST", str(channels_last))
            cfg = synthetic_cfg(cfg_args, env, steps, *extra)
            run = build_bench_run(cfg, env)
            framework_epoch(run, 1, 0)  # warm-up: one step
            repeats = 1 if slow else bench.repeats
            secs = [timed(partial(framework_epoch, run, steps, r + 1), env) for r in range(repeats)]
            images = steps * global_batch(cfg.TRAIN, env.world_size)
            report.emit(
                {
                    "what": "variant",
                    "impl": "framework",
                    **describe(cfg, env),
                    "steps": steps,
                    "repeats": repeats,
                    **spread([images / s for s in secs], "images_per_s"),
                    **spread([1000 * s / steps for s in secs], "ms_per_step"),
                }
            )


def measure_memory(run: Run, env: DistEnv, bench, report: Report) -> None:
    """The configured DIST.STRATEGY (and OPTIM.ZERO): bytes each rank holds, peak memory, trainer img/s.

    Parameters, gradients (after a backward, before the step frees them) and optimizer state
    are counted from this rank's local tensors (its shards under fsdp). One strategy per process:
    the CPU's peak RSS cannot be reset, so the driver in docs/scale-out.md starts one per setting.
    """
    cfg, steps = run.cfg, bench.steps or SYNTHETIC_STEPS
    framework_epoch(run, max(bench.warmup, 1), 0)  # creates the optimizer state
    images, targets = (t.to(env.device) for t in next(iter(run.train.loader))[:2])
    gradient_sync(run.forward_model, True)
    with autocast(cfg.TRAIN.PRECISION, env.device):
        loss = trainer.training_loss(run, images, run.forward_model(images), targets)
    loss.backward()
    held = local_state_bytes(run.model, getattr(run.optimizer, "optim", run.optimizer))  # ZeRO: the local optimizer
    run.optimizer.zero_grad(set_to_none=True)
    reset_peak_memory(env)
    secs = [timed(partial(framework_epoch, run, steps, r + 1), env) for r in range(bench.repeats)]
    total = steps * global_batch(cfg.TRAIN, env.world_size)
    report.emit(
        {
            "what": "memory",
            "strategy": cfg.DIST.STRATEGY + ("+zero1" if cfg.OPTIM.ZERO else ""),
            **describe(cfg, env),
            **{f"{k}_bytes": v for k, v in held.items()},
            "state_bytes": sum(held.values()),
            "steps": steps,
            **spread([total / s for s in secs], "images_per_s"),
            "peak_mem_mib": peak_memory_mib(env),
            "peak_mem_kind": "cuda_allocated" if env.device.type == "cuda" else "process_rss",
        }
    )


def measure_eval(run: Run, env: DistEnv, bench, report: Report) -> None:
    """trainer.validate throughput on the synthetic val split (one warm-up pass)."""
    validate(run.eval_model, run.val, run.cfg, env)
    rates = [validate(run.eval_model, run.val, run.cfg, env)["images_per_s"] for _ in range(bench.repeats)]
    report.emit(
        {
            "what": "eval",
            **describe(run.cfg, env),
            "batch_per_proc": run.cfg.TEST.BATCH_SIZE,
            "images": len(run.val.dataset),
            "repeats": bench.repeats,
            **spread(rates, "images_per_s"),
        }
    )


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


# ------------------------------------------------------------------------------------------------
# Table and entry point
# ------------------------------------------------------------------------------------------------
def _breakdown_line(r: dict) -> str:
    """A breakdown record's line: where a training step's time goes (and a teacher's forward, if any)."""
    teacher = f"  teacher ({r['teacher_arch']}) fwd {r['teacher_ms']:.1f} ms" if r.get("teacher_ms") is not None else ""
    return (
        f"breakdown {r['arch']:<20} np={r['world_size']}  data {r['data_ms']:.2f} ms  fwd+bwd "
        f"{r['fwd_bwd_ms']:.1f} ms  all-reduce (exposed) {r['allreduce_exposed_ms']:.1f} ms  optimizer "
        f"{r['optimizer_ms']:.1f} ms  lr+metrics {r['bookkeeping_ms']:.2f} ms" + teacher
    )


def format_table(records: list[dict]) -> str:
    """A human-readable summary of the JSON records."""
    lines = []
    for r in records:
        w = r.get("what")
        if w in ("train", "variant"):
            lines.append(
                f"{w:<9} {r['impl']:<9} {r['arch']:<20} np={r['world_size']} bs={r['batch_per_proc']:<4} "
                f"{r['precision']:<4} cl={int(r['channels_last'])} thr={r['threads_per_proc']}  "
                f"{r['images_per_s_median']:9.1f} img/s (min {r['images_per_s_min']:.1f}, max "
                f"{r['images_per_s_max']:.1f})  {r['ms_per_step_median']:8.1f} ms/step"
                + (f"  peak {r['peak_mem_mib']:.0f} MiB ({r['peak_mem_kind']})" if "peak_mem_mib" in r else "")
                + (f"  warm-up {r['warmup_steps']} steps {r['warmup_s']:.1f} s" if r.get("warmup_s") else "")
            )
        elif w == "ratio":
            lines.append(
                f"ratio     framework/plain {r['arch']:<10} np={r['world_size']}  {r['framework_over_plain']:.3f} "
                f"(paired: median {r['paired_ratio_median']:.3f}, min {r['paired_ratio_min']:.3f}, "
                f"max {r['paired_ratio_max']:.3f})"
            )
        elif w == "breakdown":
            lines.append(_breakdown_line(r))
        elif w in ("data", "decode_pipeline"):
            lines.append(
                f"{w:<15} {r['decoder']:<18} workers={r['workers']} np={r['world_size']} im={r['im_size']}  "
                f"{r['images_per_s']:9.1f} img/s ({r['images_per_s_per_proc']:.1f} per process)"
            )
        elif w == "packed_pipeline":
            lines.append(
                f"packed    {r['path']:<26} workers={r['workers']} im=224  {r['images_per_s_per_proc']:8.1f} img/s "
                f"({r['images_per_s_per_core']:.1f} per core; min {r['images_per_s_min']:.1f}, max "
                f"{r['images_per_s_max']:.1f}; {r['over_folder_pil_paired_median']:.2f}x folder+pil, paired)"
            )
        elif w == "worker_side":
            lines.append(
                f"worker_side {r['decoder']:<18} batch {r['batch_per_proc']}  {r['images_per_s_per_worker']:9.1f} img/s "
                f"per worker (min {r['images_per_s_min']:.1f}, max {r['images_per_s_max']:.1f})"
            )
        elif w == "decode":
            lines.append(
                f"decode    {r['decoder']:<11} {r['image']} on {r['device']}, batch {r['batch']}  "
                f"{r['images_per_s_per_proc']:9.1f} img/s (1 process; min {r['images_per_s_min']:.1f}, "
                f"max {r['images_per_s_max']:.1f})"
            )
        elif w == "memory":
            mib = {k: r[f"{k}_bytes"] / 2**20 for k in ("params", "grads", "optimizer", "state")}
            lines.append(
                f"memory    {r['strategy']:<10} {r['arch']:<20} np={r['world_size']}  params {mib['params']:.1f} + grads "
                f"{mib['grads']:.1f} + optimizer {mib['optimizer']:.1f} = {mib['state']:.1f} MiB per rank  peak "
                f"{r['peak_mem_mib']:.0f} MiB ({r['peak_mem_kind']})  {r['images_per_s_median']:.1f} img/s"
            )
        elif w == "eval":
            lines.append(
                f"eval      {r['arch']:<20} np={r['world_size']} bs={r['batch_per_proc']}  "
                f"{r['images_per_s_median']:9.1f} img/s (min {r['images_per_s_min']:.1f}, max {r['images_per_s_max']:.1f})"
            )
    return "\n".join(lines)


def benchmark(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> list[dict]:
    """Run the requested measurements; return the records (rank 0 has printed them)."""
    first = bench_cfg(cfg_args)  # a bad config fails here, before the process group starts
    env = setup_distributed(first.DIST.BACKEND, first.DIST.TIMEOUT_S)
    try:
        return measure(bench, cfg_args, first, env)
    finally:
        # After measure has returned: the runs it built (their DDP or FSDP models hold the process
        # group) went with its frame, so the group ends here, not during interpreter shutdown.
        cleanup_distributed()


def measure(bench: argparse.Namespace, cfg_args: argparse.Namespace, first: CfgNode, env: DistEnv) -> list[dict]:
    """The measurements ``bench.what`` names, in the process group ``env`` describes; their records."""
    report = Report(env, bench.json)
    what = set(bench.what)
    if what & {"train", "plain"}:  # the configured dataset, as train_net.py reads it
        measure_training(build_bench_run(first, env), bench, report, "train" in what, "plain" in what)
    run = None
    if what & {"breakdown", "eval"}:
        run = build_bench_run(synthetic_cfg(cfg_args, env, bench.steps), env)
    if "breakdown" in what:
        measure_breakdown(run, env, bench, report)
    if "eval" in what:
        measure_eval(run, env, bench, report)
    if "memory" in what:
        measure_memory(run or build_bench_run(synthetic_cfg(cfg_args, env, bench.steps), env), env, bench, report)
    if "variants" in what:
        measure_variants(cfg_args, env, bench, report)
    if "data" in what:
        measure_data(cfg_args, env, bench, report)
    if "decode" in what:
        measure_decode(cfg_args, env, bench, report)
    if "packed" in what:
        measure_packed(cfg_args, env, bench, report)
    if "index" in what and env.is_main_process:  # starts its own ranks: benchmarks/index.py
        from benchmarks import index

        found = index.measure(report.emit, bench.index_folder, bench.index_entries, bench.index_ranks, bench.repeats)
        print("\n" + index.table(found), flush=True)
    if env.is_main_process:
        print("\n" + format_table(report.records), flush=True)
    return report.records


STRATEGY_OPTS = {"ddp": [], "ddp+zero1": ["OPTIM.ZERO", "True"], "fsdp": ["DIST.STRATEGY", "fsdp"]}


def memory_table(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> str:
    """Run --what memory for every world size x arch x strategy (one torchrun job each); a markdown table."""
    own = ["--steps", str(bench.steps), "--warmup", str(bench.warmup), "--repeats", str(bench.repeats)]
    own += [*(["--cfg", cfg_args.cfg_file] if cfg_args.cfg_file else []), *cfg_args.opts]
    rows = []
    for arch in bench.archs.split(","):
        name, *kwargs = arch.split(":")  # "vit_tiny_patch16_224:img_size=32:patch_size=4": MODEL.KWARGS
        arch_opts = ["MODEL.ARCH", name, *(["MODEL.KWARGS", repr(kwargs)] if kwargs else [])]
        for world in bench.memory_table:
            results = {}
            for strategy, opts in STRATEGY_OPTS.items():
                with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
                    _torchrun(
                        world,
                        [os.path.abspath(__file__), "--what", "memory", "--json", out.name, *own, *arch_opts, *opts],
                    )
                    results[strategy] = json.loads(out.read().splitlines()[-1])
            for strategy, r in results.items():
                ratio = r["images_per_s_median"] / results["ddp"]["images_per_s_median"]
                rows.append((name, world, strategy, r, ratio))
    mib = 2**20
    lines = [
        "| model | ranks | strategy | params | grads | optimizer | sum per rank | vs ddp | peak RSS per rank | img/s | vs ddp |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arch, world, name, r, ratio in rows:
        ddp_bytes = next(x[3]["state_bytes"] for x in rows if x[:2] == (arch, world) and x[2] == "ddp")
        lines.append(
            f"| {arch} | {world} | {name} | {r['params_bytes'] / mib:.1f} MiB | {r['grads_bytes'] / mib:.1f} MiB "
            f"| {r['optimizer_bytes'] / mib:.1f} MiB | {r['state_bytes'] / mib:.1f} MiB | {r['state_bytes'] / ddp_bytes:.2f} "
            f"| {r['peak_mem_mib']:.0f} MiB | {r['images_per_s_median']:.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def _torchrun(world: int, script_args: list[str]) -> None:
    """``torchrun --nproc_per_node=world script_args`` with torchrun's agent in this process (as
    Accelerate launches it): one interpreter's start-up less a job. The workers' stdout goes to a
    temporary log folder (the table is this process's output); OMP_NUM_THREADS defaults to 1."""
    from torch.distributed import run as torchrun

    from distribuuuu.runtime.launcher import find_free_port

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    added_threads = "OMP_NUM_THREADS" not in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory(prefix="benchmark-memory-") as logs:
            torchrun.run(
                torchrun.parse_args(
                    [f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
                     "--redirects=1", f"--log-dir={logs}", *script_args]
                )
            )  # fmt: skip
    finally:
        if added_threads:
            del os.environ["OMP_NUM_THREADS"]
        for sig, handler in saved.items():  # the agent installs its own
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    bench, cfg_args = parse_bench_args(argv)
    if bench.memory_table:
        return drive_memory_table(bench, cfg_args)
    try:
        benchmark(bench, cfg_args)
    except (ConfigError, DataError, LaunchError) as e:
        # The same error on every rank (a rank's own launch error aside): printed once.
        if isinstance(e, RankLaunchError) or detect_env_rank() == 0:
            print(f"benchmark: error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches every rank: one line, as train_net.py's
        if detect_env_rank() == 0:
            print(f"benchmark: interrupted (Ctrl-C); exiting with {EXIT_INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def drive_memory_table(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> int:
    """--memory-table: print the table; a failed job or a Ctrl-C is one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        print(memory_table(bench, cfg_args))
    except ChildFailedError as e:  # the failing rank's own error is on stderr above
        rank, failure = min(e.failures.items())
        print(f"benchmark: error: a --what memory job failed: rank {rank} exited {failure.exitcode}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as e:  # torchrun's agent, in this process, raises the latter
        signum = getattr(e, "sigval", signal.SIGINT)
        print(f"benchmark: interrupted ({signal.Signals(signum).name}); no table", file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
