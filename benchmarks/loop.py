"""Training and evaluation speed: epochs of train_net.py through the trainer's own ``train_one_epoch``
against a minimal hand-written DDP loop (``PlainLoop``) on the same work, where a step's time goes
(breakdown), a bf16 and compiled variant, the model's state bytes per rank (memory), and validation."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from yacs.config import CfgNode

from benchmarks.report import (
    SYNTHETIC_STEPS,
    Report,
    describe,
    peak_memory_mib,
    reset_peak_memory,
    spread,
    sync_device,
    synthetic_cfg,
    timed,
)
from distribuuuu import trainer
from distribuuuu.records.meters import MetricSums
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.parallel import autocast, gradient_sync, local_state_bytes, to_device
from distribuuuu.training import run as run_setup
from distribuuuu.training.evaluation import validate
from distribuuuu.training.optim import LAMB, LARS, freeze, lr_at, optimizer_groups, set_lr
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.preprocessing import (
    build_normalize,
    build_train_transform,
)
from distribuuuu.training.rng import seed_everything
from distribuuuu.training.session import Session
from distribuuuu.training.state import Run, global_batch


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
