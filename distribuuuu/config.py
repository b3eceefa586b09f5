"""Configuration: yacs defaults (every key commented), loading, validation and dumping.

The keys of the original Distribuuuu keep their names and meaning, so its YAML files load
unchanged. The defaults train a small torchvision model on the embedded ``data/digits`` set.

The config is parsed once, at the edge (``tools/*.py``), validated, frozen, and then passed down;
library functions take the config (or one section of it) as an argument.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence

import yacs.config
from yacs.config import CfgNode as CN

_strict_coerce = yacs.config._check_and_coerce_cfg_value_type


def _coerce_int_to_float(replacement, original, key, full_key):
    # yacs rejects an int where the default is a float ("OPTIM.BASE_LR 1", "WARMUP_EPOCHS: 5");
    # every user trips on that, so widen exactly this case and keep all other checks strict.
    if isinstance(original, float) and type(replacement) is int:
        return float(replacement)
    return _strict_coerce(replacement, original, key, full_key)


yacs.config._check_and_coerce_cfg_value_type = _coerce_int_to_float

_C = CN()

# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
_C.MODEL = CN()
# Architecture: a torchvision classification model name, a timm name (if timm is installed), or a
# name registered with distribuuuu.models.register_model
_C.MODEL.ARCH = "resnet18"
# Number of output classes
_C.MODEL.NUM_CLASSES = 10
# Start from the architecture's pretrained torchvision/timm weights (needs them cached locally)
_C.MODEL.PRETRAINED = False
# Convert BatchNorm layers to SyncBatchNorm (CUDA only; see README "SyncBatchNorm on CPU")
_C.MODEL.SYNCBN = False
# Checkpoint whose weights initialise the model (fine-tuning) or are evaluated (test_net.py)
_C.MODEL.WEIGHTS = ""
# Which weights to take from MODEL.WEIGHTS: "model" (raw weights) or "ema" (averaged weights)
_C.MODEL.WEIGHTS_KIND = "model"
# Train and test on synthetic in-memory data of the configured size and class count
_C.MODEL.DUMMY_INPUT = False

# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
_C.TRAIN = CN()
# Images per process per micro-batch (the global batch is BATCH_SIZE x world size x ACCUM_STEPS)
_C.TRAIN.BATCH_SIZE = 32
# Training crop size (RandomResizedCrop); also the val center-crop size
_C.TRAIN.IM_SIZE = 32
# Dataset root: an ImageFolder root holding SPLIT/<class>/<image>, or cifar10/cifar100 as
# "cifar10:<root>" / "cifar100:<root>" with torchvision's extracted on-disk files
_C.TRAIN.DATASET = "data/digits"
# Split folder under TRAIN.DATASET
_C.TRAIN.SPLIT = "train"
# Resume from the newest loadable checkpoint in OUT_DIR/checkpoints, if one exists
_C.TRAIN.AUTO_RESUME = True
# On resume, also restore optimizer, LR-schedule position, scaler and EMA (False: weights only)
_C.TRAIN.LOAD_OPT = True
# DataLoader worker processes per training process
_C.TRAIN.WORKERS = 0
# Pin host memory for faster host-to-device copies (used on CUDA only)
_C.TRAIN.PIN_MEMORY = True
# Keep DataLoader workers alive between epochs (when WORKERS > 0)
_C.TRAIN.PERSISTENT_WORKERS = True
# Batches each worker loads ahead (when WORKERS > 0)
_C.TRAIN.PREFETCH_FACTOR = 2
# Log (and reduce metrics across ranks) every PRINT_FREQ optimizer steps
_C.TRAIN.PRINT_FREQ = 10
# The k of top-k accuracy (top-1 is always reported)
_C.TRAIN.TOPK = 5
# Micro-batches accumulated per optimizer step (the gradient all-reduce runs on the last only)
_C.TRAIN.ACCUM_STEPS = 1
# Mixed precision: "fp32", "bf16" (autocast) or "fp16" (autocast + GradScaler; on the CPU it runs,
# slowly, for testing the fp16 path)
_C.TRAIN.PRECISION = "fp32"
# Use channels_last memory format for the model and its inputs
_C.TRAIN.CHANNELS_LAST = False
# torch.compile the model before the DDP wrap (checkpoints stay loadable uncompiled)
_C.TRAIN.COMPILE = False
# Clip gradients to this global L2 norm (0 disables)
_C.TRAIN.CLIP_GRAD_NORM = 0.0
# Label smoothing factor of the cross-entropy loss
_C.TRAIN.LABEL_SMOOTHING = 0.0
# What a non-finite loss does: "stop" (error naming epoch and step) or "skip" (skip, count, go on)
_C.TRAIN.NAN_POLICY = "stop"
# Also write a checkpoint every N optimizer steps inside an epoch (0: only at epoch end)
_C.TRAIN.CKPT_PERIOD_ITERS = 0
# How many of the newest checkpoints to keep in OUT_DIR/checkpoints (best.pth.tar is kept apart)
_C.TRAIN.KEEP_CKPTS = 3
# Evaluate on the val split every N epochs (and always after the last)
_C.TRAIN.EVAL_PERIOD = 1
# Stop the run after this many epochs of this invocation (0: run to OPTIM.MAX_EPOCH); for tests
# and for splitting long runs into jobs
_C.TRAIN.STOP_AFTER_EPOCHS = 0

# ------------------------------------------------------------------------------------------------
# Test / validation
# ------------------------------------------------------------------------------------------------
_C.TEST = CN()
# Dataset root for evaluation (same forms as TRAIN.DATASET)
_C.TEST.DATASET = "data/digits"
# Split folder under TEST.DATASET
_C.TEST.SPLIT = "val"
# Images per process for evaluation
_C.TEST.BATCH_SIZE = 64
# Resize size before the TRAIN.IM_SIZE center crop
_C.TEST.IM_SIZE = 32
# Log every PRINT_FREQ evaluation batches
_C.TEST.PRINT_FREQ = 10

# ------------------------------------------------------------------------------------------------
# Data pipeline and augmentation
# ------------------------------------------------------------------------------------------------
_C.DATA = CN()
# Per-channel normalisation mean (RGB)
_C.DATA.MEAN = [0.485, 0.456, 0.406]
# Per-channel normalisation std (RGB)
_C.DATA.STD = [0.229, 0.224, 0.225]
# Smallest area fraction RandomResizedCrop may take (torchvision's and ImageNet's usual: 0.08)
_C.DATA.CROP_SCALE_MIN = 0.6
# Probability of a horizontal flip in training (ImageNet's usual: 0.5; digits must not be flipped)
_C.DATA.HFLIP_PROB = 0.0
# Automatic augmentation policy: "", "randaugment", "trivialaugment" or "autoaugment"
_C.DATA.AUTO_AUGMENT = ""
# RandAugment magnitude (0-30)
_C.DATA.RANDAUGMENT_MAGNITUDE = 9
# Probability of random erasing on each training image (0 disables)
_C.DATA.RANDOM_ERASING = 0.0
# Mixup alpha (0 disables mixup)
_C.DATA.MIXUP_ALPHA = 0.0
# CutMix alpha (0 disables cutmix)
_C.DATA.CUTMIX_ALPHA = 0.0
# Probability that a batch gets mixup/cutmix at all
_C.DATA.MIX_PROB = 1.0
# When both are enabled, probability of cutmix rather than mixup
_C.DATA.MIX_SWITCH_PROB = 0.5
# Unreadable or truncated image: "error" (stop naming its path) or "skip" (skip, count, warn)
_C.DATA.BAD_IMAGE = "error"
# Image decoding: "auto" (torchvision.io for JPEG, measured faster; PIL for the rest), "pil",
# "torchvision" (torchvision.io for JPEG and PNG), or "batched" (workers read JPEG bytes; the
# training process decodes each batch's JPEGs in one decode_jpeg call on its device, nvJPEG on
# GPU, and augments them there; other formats as "auto")
_C.DATA.DECODER = "auto"
# Number of synthetic samples per split when MODEL.DUMMY_INPUT is on
_C.DATA.DUMMY_SIZE = 1024

# ------------------------------------------------------------------------------------------------
# cuDNN
# ------------------------------------------------------------------------------------------------
_C.CUDNN = CN()
# Let cuDNN pick the fastest kernels for the observed shapes
_C.CUDNN.BENCHMARK = True
# Ask cuDNN (and PyTorch) for deterministic algorithms
_C.CUDNN.DETERMINISTIC = False

# ------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule (the schedule is updated every optimizer step)
# ------------------------------------------------------------------------------------------------
_C.OPTIM = CN()
# Optimizer: "sgd", "adamw" or "lars"
_C.OPTIM.OPTIMIZER = "sgd"
# Number of training epochs
_C.OPTIM.MAX_EPOCH = 10
# LR policy: "cos" (cosine to MIN_LR), "steps" (x LR_MULT at each of STEPS), "lin" (linear to MIN_LR)
_C.OPTIM.LR_POLICY = "cos"
# Base learning rate (after the optional linear scaling rule below)
_C.OPTIM.BASE_LR = 0.05
# Final learning rate of "cos" and "lin"
_C.OPTIM.MIN_LR = 0.0
# Epochs at which "steps" multiplies the LR by LR_MULT (ascending; fractional epochs allowed)
_C.OPTIM.STEPS = [30, 60, 90]
# LR multiplier at each of STEPS
_C.OPTIM.LR_MULT = 0.1
# SGD momentum (also LARS)
_C.OPTIM.MOMENTUM = 0.9
# SGD dampening
_C.OPTIM.DAMPENING = 0.0
# SGD Nesterov momentum
_C.OPTIM.NESTEROV = True
# Warmup starts at BASE_LR x WARMUP_FACTOR and rises linearly to the schedule's value
_C.OPTIM.WARMUP_FACTOR = 0.1
# Warmup length in epochs (fractional allowed; 0 disables)
_C.OPTIM.WARMUP_EPOCHS = 1.0
# Weight decay
_C.OPTIM.WEIGHT_DECAY = 5e-5
# Apply weight decay to normalisation weights and all biases too (off: they get none)
_C.OPTIM.WEIGHT_DECAY_NORM_BIAS = False
# AdamW betas
_C.OPTIM.BETAS = [0.9, 0.999]
# LARS trust coefficient
_C.OPTIM.LARS_TRUST = 0.001
# Linear scaling rule: if > 0, BASE_LR is multiplied by global_batch / REFERENCE_BATCH
_C.OPTIM.REFERENCE_BATCH = 0
# Shard optimizer state across ranks (ZeRO stage 1, ZeroRedundancyOptimizer)
_C.OPTIM.ZERO = False
# Exponential moving average of weights: decay per update (0 disables EMA)
_C.OPTIM.EMA_DECAY = 0.0
# EMA warmup: use min(EMA_DECAY, (1 + n) / (10 + n)) for the n-th update
_C.OPTIM.EMA_WARMUP = True
# Update the EMA every N optimizer steps
_C.OPTIM.EMA_PERIOD = 1

# ------------------------------------------------------------------------------------------------
# Distributed
# ------------------------------------------------------------------------------------------------
_C.DIST = CN()
# Process-group backend: "" (nccl with CUDA, else gloo), "nccl" or "gloo"
_C.DIST.BACKEND = ""
# Timeout of every collective, in seconds: a stalled rank fails the job after this long
_C.DIST.TIMEOUT_S = 600
# Timeout of the start-up health check of the group, in seconds
_C.DIST.INIT_CHECK_TIMEOUT_S = 60
# DDP gradient bucket size in MiB
_C.DIST.BUCKET_CAP_MB = 25
# DDP: gradients are views into the communication buckets (saves a copy and memory)
_C.DIST.GRADIENT_AS_BUCKET_VIEW = True
# DDP static_graph (the set of used parameters never changes)
_C.DIST.STATIC_GRAPH = False
# DDP find_unused_parameters (only for models that skip parameters in forward)
_C.DIST.FIND_UNUSED_PARAMETERS = False
# Gradient compression communication hook: "", "fp16" or "bf16"
_C.DIST.COMM_HOOK = ""
# On preemption (SIGTERM/SIGUSR1), requeue the Slurm job with scontrol after checkpointing
_C.DIST.REQUEUE = False
# After a preemption signal, exit hard if the synchronised stop has not finished in this many s
_C.DIST.PREEMPT_GRACE_S = 60

# ------------------------------------------------------------------------------------------------
# Misc
# ------------------------------------------------------------------------------------------------
# Output directory: config.yaml, metrics.jsonl, log.txt, TensorBoard events, checkpoints
_C.OUT_DIR = "output/digits"
# Config file name written into OUT_DIR
_C.CFG_DEST = "config.yaml"
# Random seed (every value, 0 included, is a seed)
_C.RNG_SEED = 1

# The global config, for command-line tools and scripts only; library code takes cfg as argument
cfg = _C.clone()

PRECISIONS = ("fp32", "bf16", "fp16")
LR_POLICIES = ("cos", "steps", "lin")
OPTIMIZERS = ("sgd", "adamw", "lars")
AUTO_AUGMENTS = ("", "randaugment", "trivialaugment", "autoaugment")
COMM_HOOKS = ("", "fp16", "bf16")
DECODERS = ("auto", "pil", "torchvision", "batched")


class ConfigError(ValueError):
    """A config value or config file is invalid; the message names the key or file."""


def get_cfg_defaults() -> CN:
    """Return a fresh copy of the default config."""
    return _C.clone()


def load_cfg(cfg_file: str | None = None, opts: Sequence[str] = ()) -> CN:
    """Build a validated, frozen config from defaults, an optional YAML file and KEY VALUE pairs."""
    config = get_cfg_defaults()
    if cfg_file:
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"config file not found: {cfg_file}")
        try:
            config.merge_from_file(cfg_file)
        except Exception as e:  # yacs raises KeyError/ValueError/yaml errors with poor context
            raise ConfigError(f"{cfg_file}: {_yacs_message(e)}") from None
    if len(opts) % 2:
        raise ConfigError(f"overrides must be KEY VALUE pairs, got an odd list: {list(opts)}")
    try:
        config.merge_from_list(list(opts))
    except Exception as e:
        raise ConfigError(f"command line: {_yacs_message(e)}") from None
    _resolve_nulls(config)
    validate_cfg(config)
    config.freeze()
    return config


# Distribuuuu's own YAML files write these two keys as null: no weights, and an unseeded run
# (every run here is seeded, so null means the default seed).
_NULL_MEANS_DEFAULT = ("MODEL.WEIGHTS", "RNG_SEED")


def _resolve_nulls(config: CN, prefix: str = "") -> None:
    """Replace the nulls Distribuuuu wrote with their defaults; any other null is a ConfigError."""
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, CN):
            _resolve_nulls(value, key + ".")
        elif value is None:
            if key not in _NULL_MEANS_DEFAULT:
                raise ConfigError(f"{key} must have a value, got null")
            default = _C
            for part in key.split("."):
                default = default[part]
            config[name] = default


def _yacs_message(e: Exception) -> str:
    """Rephrase yacs's errors so they lead with the key."""
    msg = str(e.args[0] if e.args else e)
    unknown = re.search(r"Non-existent (?:config )?key: (\S+)", msg)
    if unknown:
        return f"unknown config key {unknown.group(1)}"
    mismatch = re.search(
        r"Type mismatch \((.*?) vs\. (.*?)\) with values \((.*) vs\. (.*)\) for config key: (\S+)", msg
    )
    if mismatch:
        want, got, _, value, key = mismatch.groups()
        return f"{key} expects {_type_name(want)}, got {_type_name(got)} {value!r}"
    return msg


def _type_name(type_repr: str) -> str:
    return re.sub(r"<class '(\w+)'>", r"\1", type_repr)


def validate_cfg(c: CN) -> None:
    """Raise ConfigError naming the first key whose value is invalid."""

    def check(ok: bool, key: str, why: str, value) -> None:
        if not ok:
            raise ConfigError(f"{key} {why}, got {value!r}")

    check(c.TRAIN.BATCH_SIZE > 0, "TRAIN.BATCH_SIZE", "must be > 0", c.TRAIN.BATCH_SIZE)
    check(c.TEST.BATCH_SIZE > 0, "TEST.BATCH_SIZE", "must be > 0", c.TEST.BATCH_SIZE)
    check(c.TRAIN.IM_SIZE > 0, "TRAIN.IM_SIZE", "must be > 0", c.TRAIN.IM_SIZE)
    check(c.TEST.IM_SIZE >= c.TRAIN.IM_SIZE, "TEST.IM_SIZE", "must be >= TRAIN.IM_SIZE", c.TEST.IM_SIZE)
    check(c.MODEL.NUM_CLASSES > 0, "MODEL.NUM_CLASSES", "must be > 0", c.MODEL.NUM_CLASSES)
    check(
        1 <= c.TRAIN.TOPK <= c.MODEL.NUM_CLASSES,
        "TRAIN.TOPK",
        f"must be in 1..MODEL.NUM_CLASSES ({c.MODEL.NUM_CLASSES})",
        c.TRAIN.TOPK,
    )
    check(c.TRAIN.PRINT_FREQ > 0, "TRAIN.PRINT_FREQ", "must be > 0", c.TRAIN.PRINT_FREQ)
    check(c.TEST.PRINT_FREQ > 0, "TEST.PRINT_FREQ", "must be > 0", c.TEST.PRINT_FREQ)
    check(c.TRAIN.WORKERS >= 0, "TRAIN.WORKERS", "must be >= 0", c.TRAIN.WORKERS)
    check(c.TRAIN.PREFETCH_FACTOR > 0, "TRAIN.PREFETCH_FACTOR", "must be > 0", c.TRAIN.PREFETCH_FACTOR)
    check(c.TRAIN.ACCUM_STEPS >= 1, "TRAIN.ACCUM_STEPS", "must be >= 1", c.TRAIN.ACCUM_STEPS)
    check(c.TRAIN.PRECISION in PRECISIONS, "TRAIN.PRECISION", f"must be one of {PRECISIONS}", c.TRAIN.PRECISION)
    check(c.TRAIN.CLIP_GRAD_NORM >= 0, "TRAIN.CLIP_GRAD_NORM", "must be >= 0", c.TRAIN.CLIP_GRAD_NORM)
    check(0 <= c.TRAIN.LABEL_SMOOTHING < 1, "TRAIN.LABEL_SMOOTHING", "must be in [0, 1)", c.TRAIN.LABEL_SMOOTHING)
    check(c.TRAIN.NAN_POLICY in ("stop", "skip"), "TRAIN.NAN_POLICY", "must be 'stop' or 'skip'", c.TRAIN.NAN_POLICY)
    check(c.TRAIN.CKPT_PERIOD_ITERS >= 0, "TRAIN.CKPT_PERIOD_ITERS", "must be >= 0", c.TRAIN.CKPT_PERIOD_ITERS)
    check(c.TRAIN.KEEP_CKPTS >= 1, "TRAIN.KEEP_CKPTS", "must be >= 1", c.TRAIN.KEEP_CKPTS)
    check(c.TRAIN.EVAL_PERIOD >= 1, "TRAIN.EVAL_PERIOD", "must be >= 1", c.TRAIN.EVAL_PERIOD)
    check(c.TRAIN.STOP_AFTER_EPOCHS >= 0, "TRAIN.STOP_AFTER_EPOCHS", "must be >= 0", c.TRAIN.STOP_AFTER_EPOCHS)
    check(
        c.MODEL.WEIGHTS_KIND in ("model", "ema"), "MODEL.WEIGHTS_KIND", "must be 'model' or 'ema'", c.MODEL.WEIGHTS_KIND
    )

    check(
        len(c.DATA.MEAN) == 3 and len(c.DATA.STD) == 3,
        "DATA.MEAN/DATA.STD",
        "must have 3 values",
        (c.DATA.MEAN, c.DATA.STD),
    )
    check(all(s > 0 for s in c.DATA.STD), "DATA.STD", "must be > 0", c.DATA.STD)
    check(0 < c.DATA.CROP_SCALE_MIN <= 1, "DATA.CROP_SCALE_MIN", "must be in (0, 1]", c.DATA.CROP_SCALE_MIN)
    check(0 <= c.DATA.HFLIP_PROB <= 1, "DATA.HFLIP_PROB", "must be in [0, 1]", c.DATA.HFLIP_PROB)
    check(
        c.DATA.AUTO_AUGMENT in AUTO_AUGMENTS,
        "DATA.AUTO_AUGMENT",
        f"must be one of {AUTO_AUGMENTS}",
        c.DATA.AUTO_AUGMENT,
    )
    check(0 <= c.DATA.RANDOM_ERASING <= 1, "DATA.RANDOM_ERASING", "must be in [0, 1]", c.DATA.RANDOM_ERASING)
    check(c.DATA.MIXUP_ALPHA >= 0, "DATA.MIXUP_ALPHA", "must be >= 0", c.DATA.MIXUP_ALPHA)
    check(c.DATA.CUTMIX_ALPHA >= 0, "DATA.CUTMIX_ALPHA", "must be >= 0", c.DATA.CUTMIX_ALPHA)
    check(0 <= c.DATA.MIX_PROB <= 1, "DATA.MIX_PROB", "must be in [0, 1]", c.DATA.MIX_PROB)
    check(0 <= c.DATA.MIX_SWITCH_PROB <= 1, "DATA.MIX_SWITCH_PROB", "must be in [0, 1]", c.DATA.MIX_SWITCH_PROB)
    check(c.DATA.BAD_IMAGE in ("error", "skip"), "DATA.BAD_IMAGE", "must be 'error' or 'skip'", c.DATA.BAD_IMAGE)
    check(c.DATA.DECODER in DECODERS, "DATA.DECODER", f"must be one of {DECODERS}", c.DATA.DECODER)
    if c.DATA.DECODER == "batched":
        import torchvision.io  # only here: the config module stays light for tools that only read it

        # torchvision 0.29 deprecated its image decoders (TorchCodec succeeds them).
        gone = "'batched' needs torchvision.io.decode_jpeg, gone from this torchvision"
        check(hasattr(torchvision.io, "decode_jpeg"), "DATA.DECODER", gone, "batched")
    check(c.DATA.DUMMY_SIZE > 0, "DATA.DUMMY_SIZE", "must be > 0", c.DATA.DUMMY_SIZE)

    o = c.OPTIM
    check(o.OPTIMIZER in OPTIMIZERS, "OPTIM.OPTIMIZER", f"must be one of {OPTIMIZERS}", o.OPTIMIZER)
    check(o.MAX_EPOCH > 0, "OPTIM.MAX_EPOCH", "must be > 0", o.MAX_EPOCH)
    check(o.LR_POLICY in LR_POLICIES, "OPTIM.LR_POLICY", f"must be one of {LR_POLICIES}", o.LR_POLICY)
    check(o.BASE_LR > 0, "OPTIM.BASE_LR", "must be > 0", o.BASE_LR)
    check(0 <= o.MIN_LR <= o.BASE_LR, "OPTIM.MIN_LR", "must be in [0, OPTIM.BASE_LR]", o.MIN_LR)
    steps = list(o.STEPS)
    check(
        all(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 for s in steps)
        and steps == sorted(steps),
        "OPTIM.STEPS",
        "must be a list of ascending positive epochs",
        o.STEPS,
    )
    check(o.LR_MULT > 0, "OPTIM.LR_MULT", "must be > 0", o.LR_MULT)
    check(o.MOMENTUM >= 0, "OPTIM.MOMENTUM", "must be >= 0", o.MOMENTUM)
    check(0 <= o.DAMPENING < 1, "OPTIM.DAMPENING", "must be in [0, 1)", o.DAMPENING)
    check(
        not (o.NESTEROV and o.OPTIMIZER == "sgd" and (o.MOMENTUM <= 0 or o.DAMPENING != 0)),
        "OPTIM.NESTEROV",
        "needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING == 0",
        o.NESTEROV,
    )
    check(0 < o.WARMUP_FACTOR <= 1, "OPTIM.WARMUP_FACTOR", "must be in (0, 1]", o.WARMUP_FACTOR)
    check(
        0 <= o.WARMUP_EPOCHS <= o.MAX_EPOCH, "OPTIM.WARMUP_EPOCHS", "must be in [0, OPTIM.MAX_EPOCH]", o.WARMUP_EPOCHS
    )
    check(o.WEIGHT_DECAY >= 0, "OPTIM.WEIGHT_DECAY", "must be >= 0", o.WEIGHT_DECAY)
    check(
        len(o.BETAS) == 2 and all(0 <= b < 1 for b in o.BETAS), "OPTIM.BETAS", "must be two values in [0, 1)", o.BETAS
    )
    check(o.LARS_TRUST > 0, "OPTIM.LARS_TRUST", "must be > 0", o.LARS_TRUST)
    check(o.REFERENCE_BATCH >= 0, "OPTIM.REFERENCE_BATCH", "must be >= 0", o.REFERENCE_BATCH)
    check(0 <= o.EMA_DECAY < 1, "OPTIM.EMA_DECAY", "must be in [0, 1)", o.EMA_DECAY)
    check(o.EMA_PERIOD >= 1, "OPTIM.EMA_PERIOD", "must be >= 1", o.EMA_PERIOD)

    d = c.DIST
    check(d.BACKEND in ("", "nccl", "gloo"), "DIST.BACKEND", "must be '', 'nccl' or 'gloo'", d.BACKEND)
    check(d.TIMEOUT_S > 0, "DIST.TIMEOUT_S", "must be > 0", d.TIMEOUT_S)
    check(d.INIT_CHECK_TIMEOUT_S > 0, "DIST.INIT_CHECK_TIMEOUT_S", "must be > 0", d.INIT_CHECK_TIMEOUT_S)
    check(d.BUCKET_CAP_MB > 0, "DIST.BUCKET_CAP_MB", "must be > 0", d.BUCKET_CAP_MB)
    check(d.PREEMPT_GRACE_S > 0, "DIST.PREEMPT_GRACE_S", "must be > 0", d.PREEMPT_GRACE_S)
    check(d.COMM_HOOK in COMM_HOOKS, "DIST.COMM_HOOK", f"must be one of {COMM_HOOKS}", d.COMM_HOOK)
    check(bool(c.OUT_DIR), "OUT_DIR", "must not be empty", c.OUT_DIR)
    check(bool(c.CFG_DEST) and os.sep not in c.CFG_DEST, "CFG_DEST", "must be a file name", c.CFG_DEST)


def check_dataset_paths(c: CN) -> None:
    """Raise ConfigError naming a dataset folder that does not exist (unless DUMMY_INPUT)."""
    if c.MODEL.DUMMY_INPUT:
        return
    for key, root, split in (
        ("TRAIN.DATASET", c.TRAIN.DATASET, c.TRAIN.SPLIT),
        ("TEST.DATASET", c.TEST.DATASET, c.TEST.SPLIT),
    ):
        kind, _, path = root.partition(":") if root.split(":", 1)[0] in ("cifar10", "cifar100") else ("", "", root)
        if kind:
            if not os.path.isdir(path):
                raise ConfigError(f"{key}: CIFAR folder not found: {path}")
            continue
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            raise ConfigError(f"{key}: dataset folder not found: {folder} (split {split!r})")


def dump_cfg(c: CN, out_dir: str) -> str:
    """Write the config as YAML to OUT_DIR/CFG_DEST and return its path."""
    path = os.path.join(out_dir, c.CFG_DEST)
    with open(path, "w") as f:
        f.write(c.dump())
    return path


def parse_args(argv: Sequence[str] | None = None, description: str = "") -> argparse.Namespace:
    """Parse ``--cfg FILE [KEY VALUE ...]``; also accept the old launcher's --local_rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cfg", dest="cfg_file", default=None, help="YAML config file")
    # torch.distributed.launch passes --local_rank (old) or --local-rank (torch >= 2.0); the value
    # is also in the LOCAL_RANK environment variable, which is what setup_distributed reads.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start N local worker processes without a launcher (torch.multiprocessing spawn)",
    )
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args
