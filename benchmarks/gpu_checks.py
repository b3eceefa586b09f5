"""The checks of tools/gpu_check.py: what the CPU-only test suite cannot run (NCCL, SyncBatchNorm,
fp16, compile, pinned copies, nvJPEG, host syncs, the prepare thread on a node of several GPUs,
fsdp's sharded checkpoints, resume), each a function of the run's Context returning its detail."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from benchmarks.gpu_harness import (
    TINY,
    TINY_NO_BN,
    CheckFailed,
    Context,
    Skip,
    augment_syncs,
    batched_val_passes,
    build_tiny_run,
    expect,
    expect_close,
    full_weights,
    jpeg_dataset,
    jpeg_tree,
    kernel_streams,
    loss_falls,
    make_cfg,
    needs_cuda,
    physical_device,
    primary_contexts,
    train_steps,
    window_without_sync,
)
from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.data import batched
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import (
    all_gather_object,
    all_reduce_sum,
    check_group,
)
from distribuuuu.training import parallelize
from distribuuuu.training.inputs import build_train_split, build_val_split
from distribuuuu.training.preprocessing import build_normalize
from distribuuuu.training.resume import checkpointer, resume_or_load_weights, save_training_checkpoint


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
