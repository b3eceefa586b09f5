"""Configuration: yacs defaults (every key commented), loading, validation and dumping.

The keys of the original Distribuuuu keep their names and meaning, so its YAML files load
unchanged. The defaults train a small torchvision model on the embedded ``data/digits`` set.

The config is parsed once, at the edge (``tools/*.py``), validated, frozen, and then passed down;
library functions take the config (or one section of it) as an argument.
"""

from __future__ import annotations

import ast
import difflib
import math
import os
import re
import reprlib
from collections.abc import Sequence
from typing import Any, Callable

import yaml
from yacs.config import CfgNode as CN

from distribuuuu.errors import ConfigError, first_line

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
# "multiclass" (one class an image: softmax, cross-entropy, top-k accuracy) or "multilabel" (any
# number of classes an image: per-class sigmoid, BCE, mAP and F1; docs/annotations.md)
_C.MODEL.TASK = "multiclass"
# Start from the architecture's default pretrained torchvision/timm weights (needs them cached locally)
_C.MODEL.PRETRAINED = False
# Pretrained weights by name (implies pretrained): a torchvision weight enum name ("IMAGENET1K_V2",
# "DEFAULT") or a timm tag ("a1_in1k"); "" with PRETRAINED True means the default weights
_C.MODEL.PRETRAINED_WEIGHTS = ""
# Extra constructor arguments as "name=value" strings, values read as Python literals
# (["drop_path_rate=0.1", "dropout=0.2"]); a name the constructor does not take is an error
_C.MODEL.KWARGS = []
# Zero-initialise the last BatchNorm scale of each ResNet-style residual block (ResNet, ResNeXt, Wide
# ResNet, RegNet), so that each block starts as the identity (Goyal et al. 2017; timm's default;
# docs/recipe.md#defaults): other models, and pretrained weights, are left as they are
_C.MODEL.ZERO_INIT_RESIDUAL = True
# Activation (gradient) checkpointing of the repeated blocks: less memory, one more forward per step
_C.MODEL.GRAD_CHECKPOINT = False
# Freeze parameters whose names match any of these fnmatch patterns (["conv1.*", "bn1.*"])
_C.MODEL.FREEZE = []
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
# Dataset root: an ImageFolder root holding SPLIT/<class>/<image>, cifar10/cifar100 as
# "cifar10:<root>" / "cifar100:<root>" with torchvision's extracted on-disk files, or a packed
# dataset (tools/pack_dataset.py: SPLIT/index.json + WebDataset shards) as a folder or a URL
# (http(s)://, or s3:// gs:// az:// with the cloud extra; credentials from the environment),
# or a Hugging Face image dataset saved with save_to_disk (SPLIT/state.json, an Image and a ClassLabel column; needs `datasets`)
_C.TRAIN.DATASET = "data/digits"
# Split folder under TRAIN.DATASET
_C.TRAIN.SPLIT = "train"
# Annotation file listing the training images and their labels (CSV, TSV or text; docs/annotations.md),
# relative to TRAIN.DATASET unless absolute, its image paths too ("": TRAIN.DATASET's SPLIT folder)
_C.TRAIN.ANN_FILE = ""
# Resume from the newest loadable checkpoint in OUT_DIR/checkpoints, if one exists
_C.TRAIN.AUTO_RESUME = True
# On resume, also restore optimizer, LR-schedule position, scaler and EMA (False: weights only)
_C.TRAIN.LOAD_OPT = True
# Resume the checkpoint in OUT_DIR even when it was trained with another MODEL.ARCH,
# MODEL.NUM_CLASSES, dataset, TRAIN.IM_SIZE or OPTIM.OPTIMIZER (off: that is an error)
_C.TRAIN.RESUME_ANYWAY = False
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
# Label smoothing factor of the loss (timm's and torchvision's recipes: 0.1; docs/recipe.md#defaults;
# 0 for a run meant to be a distillation teacher)
_C.TRAIN.LABEL_SMOOTHING = 0.1
# Training loss: "ce" (cross-entropy) or "bce" (binary cross-entropy per class, timm A1 / DeiT III);
# MODEL.TASK multilabel always trains with per-class sigmoid BCE
_C.TRAIN.LOSS = "ce"
# BCE only: targets above this become 1, the rest 0 (timm's bce_target_thresh, e.g. 0.2; 0 disables)
_C.TRAIN.BCE_TARGET_THRESHOLD = 0.0
# Class weights of the training loss: "none" or "balanced" (N / (C x count), from the train split)
_C.TRAIN.CLASS_WEIGHTS = "none"
# The val metric that chooses best.pth.tar: "top1" (highest), "map", "f1_macro" (highest; MODEL.TASK
# multilabel) or "loss" (lowest); recorded in the checkpoint and the run summary
_C.TRAIN.BEST_METRIC = "top1"
# Training sampler: "default" (shuffled), "repeated" (repeated augmentation, DeiT) or "weighted"
# (classes drawn equally often, with replacement)
_C.TRAIN.SAMPLER = "default"
# Copies of each drawn sample per epoch with TRAIN.SAMPLER "repeated"
_C.TRAIN.REPEATED_AUG = 3
# What a non-finite loss does: "stop" (error naming epoch and step) or "skip" (skip, count, go on)
_C.TRAIN.NAN_POLICY = "stop"
# Also write a checkpoint every N optimizer steps inside an epoch (0: only at epoch end)
_C.TRAIN.CKPT_PERIOD_ITERS = 0
# How many of the newest checkpoints to keep in OUT_DIR/checkpoints (best.pth.tar is kept apart)
_C.TRAIN.KEEP_CKPTS = 3
# Write checkpoint files in the background while training goes on (rank 0 keeps a host copy of
# the state until the file is on disk; one write at a time); False: each write blocks training
_C.TRAIN.CKPT_ASYNC = True
# Evaluate on the val split every N epochs (and always after the last)
_C.TRAIN.EVAL_PERIOD = 1
# Stop the run after this many epochs of this invocation (0: run to OPTIM.MAX_EPOCH); for tests
# and for splitting long runs into jobs
_C.TRAIN.STOP_AFTER_EPOCHS = 0
# Progressive resizing (FFCV's get_resolution; docs/recipe.md): the training crop of the epoch
# numbered e from 0 is PROGRESSIVE_START_SIZE while e <= PROGRESSIVE_START_EPOCH, TRAIN.IM_SIZE from
# e = PROGRESSIVE_END_EPOCH on, and between them linearly interpolated and rounded to a multiple of
# PROGRESSIVE_SIZE_MULTIPLE. The ramp ends at TRAIN.IM_SIZE (the crop of the last epochs, the
# default eval crop, what a resume checks), so it has no key of its own. Evaluation is unchanged.
# 0 disables
_C.TRAIN.PROGRESSIVE_START_SIZE = 0
# The last epoch (from 0) at the start size; the ramp starts after it (FFCV's start_ramp)
_C.TRAIN.PROGRESSIVE_START_EPOCH = 0
# The first epoch (from 0) at TRAIN.IM_SIZE (FFCV's end_ramp): above START_EPOCH; at or past
# OPTIM.MAX_EPOCH the run ends inside the ramp (a warning says so)
_C.TRAIN.PROGRESSIVE_END_EPOCH = 0
# The ramp's sizes are multiples of this (FFCV: 32); PROGRESSIVE_START_SIZE and TRAIN.IM_SIZE must be too
_C.TRAIN.PROGRESSIVE_SIZE_MULTIPLE = 32

# ------------------------------------------------------------------------------------------------
# Test / validation
# ------------------------------------------------------------------------------------------------
_C.TEST = CN()
# Dataset root for evaluation (same forms as TRAIN.DATASET)
_C.TEST.DATASET = "data/digits"
# Split folder under TEST.DATASET
_C.TEST.SPLIT = "val"
# Annotation file of the evaluation images, relative to TEST.DATASET (and to each of
# TEST.EXTRA_DATASETS) unless absolute, as TRAIN.ANN_FILE ("": the SPLIT folder)
_C.TEST.ANN_FILE = ""
# Images per process for evaluation
_C.TEST.BATCH_SIZE = 64
# Resize size (shorter side) before the center crop; timm and torchvision name the crop instead
_C.TEST.IM_SIZE = 32
# MODEL.TASK multilabel: a class is predicted when its sigmoid score is at least this (F1,
# precision, recall; predict.py)
_C.TEST.THRESHOLD = 0.5
# MODEL.TASK multilabel: the score quantisation of the exact mAP, levels per class (logits in
# [-16, 16]); the counts take 16 x MODEL.NUM_CLASSES x AP_BINS bytes on each rank, whatever the
# val set's size (docs/annotations.md)
_C.TEST.AP_BINS = 4096
# Center-crop size of evaluation (0: TRAIN.IM_SIZE)
_C.TEST.CROP_SIZE = 0
# Crop ratio: if > 0, resize to crop size / CROP_PCT instead of TEST.IM_SIZE (timm's crop_pct;
# 0.875 is ImageNet's 256 -> 224); 0 with a pretrained timm model takes the model's own
_C.TEST.CROP_PCT = 0.0
# Resize interpolation of evaluation: "bilinear", "bicubic" or "nearest" ("": bilinear, or a
# pretrained timm model's own)
_C.TEST.INTERPOLATION = ""
# More evaluation sets after each epoch: roots in TEST.DATASET's forms, each read at TEST.SPLIT
_C.TEST.EXTRA_DATASETS = []
# Also save the confusion matrix and per-class accuracy (CSV, JSON, PNG) of each evaluation
_C.TEST.CONFUSION = False
# Also save each image's path, target and top-k predictions (CSV) of each evaluation
_C.TEST.SAVE_PREDICTIONS = False
# Log every PRINT_FREQ evaluation batches
_C.TEST.PRINT_FREQ = 10
# Evaluate a folder whose classes differ from the model's: only the classes both have (folders
# the model does not know are left out); off, any difference is an error
_C.TEST.CLASS_OVERLAP = False

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
# An image whose header declares more pixels (width x height) is refused by every decoder before it
# is decoded, as a bad image (DATA.BAD_IMAGE; a 3 KB JPEG can declare 20000x20000, 1.2 GB decoded);
# 0: no limit. The default is PIL's Image.MAX_IMAGE_PIXELS, where PIL only warns (it refuses at twice)
_C.DATA.MAX_IMAGE_PIXELS = 89_478_485
# Image decoding: "auto" (JPEG with TorchCodec if installed, else torchvision.io while it has its
# deprecated decoders, else PIL; PIL for the rest), "pil", "torchvision" (torchvision.io for JPEG
# and PNG), or "batched" (workers read JPEG bytes; the training process decodes each batch's JPEGs
# in one call on its device, nvJPEG on GPU, and crops, resizes and flips the batch there at once,
# from crops drawn in the workers; other formats as "auto"; a failing GPU decoder falls back to the
# CPU with one warning; docs/performance.md), or "draft" (PIL, decoding a JPEG at
# 1/2, 1/4 or 1/8 scale, libjpeg's DCT scaling, when the sampled crop or the val resize is at least
# that many times the output: fewer pixels decoded, slightly different ones; docs/packed-data.md)
_C.DATA.DECODER = "auto"
# DATA.DECODER batched: crop, resize, flip and normalise each batch at once on the device (True), or
# run the per-sample transforms there one image at a time, as before the batched resample (False:
# the same pixels as "auto", for comparison)
_C.DATA.BATCHED_AUGMENT = True
# Folder for shards of a packed dataset read from a URL, and for links to a local one's shards, which
# the reader opens through it ("": <temp dir>/distribuuuu-shards/<hash>)
_C.DATA.SHARD_CACHE = ""
# Shuffle a packed TRAIN.DATASET by windows of this many shards (0: one global permutation): the
# shards are shuffled, then the samples within each window of consecutive shards, so the ranks
# read a few shards at a time (a URL's shards arrive as needed); exact, resumable, any world
# size (docs/packed-data.md, "Shard-aware order")
_C.DATA.SHUFFLE_WINDOW = 0
# Bytes of a URL TRAIN.DATASET's shards kept in DATA.SHARD_CACHE at most (0: unbounded, every shard
# kept): shards the DATA.SHUFFLE_WINDOW order has read are evicted, one download a shard per node,
# shared by its ranks and workers; needs DATA.SHUFFLE_WINDOW > 0 and room for two windows; local
# datasets are read in place (docs/packed-data.md, "Bounded shard cache")
_C.DATA.SHARD_CACHE_LIMIT = 0
# With DATA.SHARD_CACHE_LIMIT: shards downloaded ahead of need, past the window being read and the next
_C.DATA.SHARD_PREFETCH = 2
# Number of synthetic samples per split when MODEL.DUMMY_INPUT is on
_C.DATA.DUMMY_SIZE = 1024
# The first line of TRAIN.ANN_FILE / TEST.ANN_FILE is a header (skipped)
_C.DATA.ANN_HEADER = False
# MODEL.TASK multilabel: the separator of the class names in an annotation file's label field
_C.DATA.ANN_LABEL_SEP = " "
# Class names of annotation files, one a line, in class-index order, relative to TRAIN.DATASET
# unless absolute ("": the labels the file holds, sorted as ImageFolder sorts its folders)
_C.DATA.ANN_CLASSES = ""

# ------------------------------------------------------------------------------------------------
# Knowledge distillation: a frozen teacher's logits mixed into the training loss (docs/distillation.md)
# ------------------------------------------------------------------------------------------------
_C.DISTILL = CN()
# The teacher's checkpoint, a file or a .dcp folder ("": no distillation); its architecture, class
# count and MODEL.KWARGS come from the config it stores
_C.DISTILL.TEACHER = ""
# The teacher's architecture, for weights that store none (a bare state_dict); "" takes the checkpoint's
_C.DISTILL.ARCH = ""
# Which of the teacher checkpoint's weights: "model" (raw) or "ema" (averaged)
_C.DISTILL.WEIGHTS_KIND = "model"
# Weight of the distillation term: loss = (1 - ALPHA) x task loss + ALPHA x distillation loss
_C.DISTILL.ALPHA = 0.5
# Softmax temperature T of the soft term, T^2 x KL(teacher / T || student / T) (Hinton et al.)
_C.DISTILL.TEMPERATURE = 4.0
# Hard-label distillation (DeiT): cross-entropy against the teacher's argmax instead of the soft term
_C.DISTILL.HARD = False
# fsdp/hsdp: shard the teacher with fully_shard too (for a teacher too large to replicate); False
# replicates it on every rank
_C.DISTILL.SHARD_TEACHER = False

# ------------------------------------------------------------------------------------------------
# Precise BatchNorm (pycls): running statistics recomputed before each evaluation
# ------------------------------------------------------------------------------------------------
_C.BN = CN()
# Training images over which BatchNorm running statistics (raw and EMA weights) are recomputed
# before each evaluation and in test_net.py, the same images for any world size (0: off)
_C.BN.PRECISE_IMAGES = 0
# Their transform: "train" (the training augmentation, seeded per image: the inputs the weights
# were trained on, as pycls) or "val" (the evaluation resize and crop: the inputs evaluated)
_C.BN.PRECISE_TRANSFORM = "train"

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
# Optimizer: "sgd", "adamw", "lars" or "lamb"
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
# Parameters whose names match these fnmatch patterns get no weight decay (beside 1-D ones and
# the model's own no_weight_decay())
_C.OPTIM.NO_WEIGHT_DECAY = []
# LR multiplier of the classifier head (fine-tuning a new head: e.g. 10)
_C.OPTIM.HEAD_LR_MULT = 1.0
# Layer-wise LR decay: block i of N gets LR x LAYER_DECAY ** (N + 1 - i) (the blocks FSDP wraps; 0 disables)
_C.OPTIM.LAYER_DECAY = 0.0
# AdamW and LAMB betas
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
# Name the ranks whose heartbeat (a thread writing to the rendezvous store) stopped for this many
# seconds: a stopped, dead or GIL-blocked process, named on any backend before the collective
# timeout; 0: half of DIST.TIMEOUT_S, at most 120. Must be below DIST.TIMEOUT_S
_C.DIST.STALL_S = 0.0
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
# One run per OUT_DIR: a lock untouched for this many seconds is stale (its run is gone) and taken
# over; a running holder touches it every 30 s
_C.DIST.LOCK_STALE_S = 120.0
# A requeued or restarted job (SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT > 0) waits this many
# seconds for its predecessor to let go of OUT_DIR; a first start stops at once
_C.DIST.LOCK_WAIT_S = 300.0
# Data parallelism: "ddp" (replicated weights), "fsdp" (FSDP2: parameters, gradients and optimizer
# state sharded over all ranks) or "hsdp" (sharded within a node, replicated across nodes)
_C.DIST.STRATEGY = "ddp"
# fsdp/hsdp: free each block's gathered weights after its forward (least memory, one more
# all-gather in backward); False keeps them until backward
_C.DIST.RESHARD_AFTER_FORWARD = True
# Checkpoint format: "" (sharded DCP directories under fsdp/hsdp, single files under ddp),
# "sharded" or "file"; resume reads either
_C.DIST.CKPT_FORMAT = ""

# ------------------------------------------------------------------------------------------------
# Misc
# ------------------------------------------------------------------------------------------------
# Output directory: config.yaml, metrics.jsonl, log.txt, TensorBoard events, checkpoints
_C.OUT_DIR = "output/digits"
# Config file name written into OUT_DIR
_C.CFG_DEST = "config.yaml"
# Random seed (every value, 0 included, is a seed)
_C.RNG_SEED = 1

# ------------------------------------------------------------------------------------------------
# Logging: experiment trackers and the terminal progress bar (rank 0 only)
# ------------------------------------------------------------------------------------------------
_C.LOG = CN()
# Experiment trackers that get the metrics.jsonl scalars and the config: a list of "wandb" and/or
# "mlflow" (optional extras: pip install "distribuuuu[wandb]" / "distribuuuu[mlflow]")
_C.LOG.TRACKERS = []
# Tracker project: the W&B project and the MLflow experiment name
_C.LOG.PROJECT = "distribuuuu"
# Tracker run name ("" = the base name of OUT_DIR); a resumed run continues the same tracker run
_C.LOG.RUN_NAME = ""
# W&B mode: "offline" (writes OUT_DIR/wandb, no network; upload with `wandb sync`) or "online"
_C.LOG.WANDB_MODE = "offline"
# MLflow tracking URI ("" = a local file store in OUT_DIR/mlruns, no network)
_C.LOG.MLFLOW_URI = ""
# A progress bar on rank 0 when stdout is a terminal (never under Slurm); log.txt keeps every line
_C.LOG.PROGRESS = True
# Rank 0 logs to stdout as well as OUT_DIR/log.txt (False: log.txt only, for a tool that prints its own report)
_C.LOG.CONSOLE = True
# Draw OUT_DIR/metrics.png at the end of training (~1 s of one core, with matplotlib); False: summary.md
# without it, for sweeps of short runs (tools/plot_metrics.py OUT_DIR draws it at any time)
_C.LOG.PLOT = True

PRECISIONS = ("fp32", "bf16", "fp16")
LR_POLICIES = ("cos", "steps", "lin")
OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
INTERPOLATIONS = ("", "bilinear", "bicubic", "nearest")
SAMPLERS = ("default", "repeated", "weighted")
TASKS = ("multiclass", "multilabel")
# TRAIN.BEST_METRIC: each metric's metrics.jsonl field and whether a lower value is better
BEST_METRICS = {"top1": ("top1", False), "map": ("map", False), "f1_macro": ("f1_macro", False), "loss": ("loss", True)}
AUTO_AUGMENTS = ("", "randaugment", "trivialaugment", "autoaugment")
COMM_HOOKS = ("", "fp16", "bf16")
STRATEGIES = ("ddp", "fsdp", "hsdp")
CKPT_FORMATS = ("", "sharded", "file")
DECODERS = ("auto", "pil", "torchvision", "batched", "draft")
TRACKERS = ("wandb", "mlflow")


def get_cfg_defaults() -> CN:
    """Return a fresh copy of the default config."""
    return _C.clone()


def load_cfg(cfg_file: str | None = None, opts: Sequence[str] = (), base: CN | None = None) -> CN:
    """Build a validated, frozen config from ``base`` (the defaults), a YAML file and KEY VALUE pairs."""
    config = (base or _C).clone()
    if cfg_file:
        _merge(config, _read_yaml(cfg_file), cfg_file)
    if len(opts) % 2:
        raise ConfigError(f"overrides must be KEY VALUE pairs, got an odd list: {_shown(list(opts))}")
    pairs = {key: _decode(value, f"command line: {key}") for key, value in zip(opts[0::2], opts[1::2])}
    _merge(config, _unflatten(pairs, "command line"), "command line")
    _resolve_nulls(config)
    validate_cfg(config)
    config.freeze()
    return config


def _read_yaml(path: str) -> dict:
    """The mapping in a YAML file, or a ConfigError naming the file, the problem and its position."""
    if path.endswith(".py"):  # yacs's merge_from_file would run it (its _load_cfg_py_source): a config is data
        raise ConfigError(f"{path}: a Python file; configs are YAML, and no config file is ever run")
    try:
        data = yaml.load(_read_config_bytes(path), Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}{_configs_that_exist()}") from None
    except _Refused as e:
        raise ConfigError(f"{path}{e.where}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        context = f" ({e.context})" if e.context else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {e.problem}{context}") from None
    except (yaml.YAMLError, OSError) as e:
        raise ConfigError(f"{path}: cannot read it as YAML: {first_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got a {type(data).__name__}")
    return data


# A config file is a small document a person writes (every key written out is ~3 KB): a far larger
# file is a mistake (a dataset or a checkpoint given as --cfg, /dev/zero), refused unread.
_MAX_CONFIG_BYTES = 256 * 1024
# SECTION: KEY: [list] is three levels; deeper is refused before PyYAML's recursive composer meets
# Python's recursion limit (a RecursionError traceback at ~1000 levels of "[").
_MAX_YAML_DEPTH = 16


def _read_config_bytes(path: str) -> bytes:
    """The file's bytes (PyYAML decodes them as YAML says: UTF-8, or UTF-16/32 with a BOM), or a
    ConfigError for a file too large to be a config."""
    with open(path, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than 256 KiB, too large for a config file (every key written out is ~3 KB)")
    return data


class _Refused(Exception):
    """What ``_ConfigLoader`` refuses, and where (``:line:column`` or ""); ``_read_yaml`` names the file."""

    def __init__(self, text: str, mark: yaml.Mark | None = None):
        super().__init__(text)
        self.where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, strict for config files: no aliases, no key given twice, bounded nesting,
    and PyYAML's own ValueErrors (a date with month 13) as a ``_Refused`` naming the line."""

    def __init__(self, stream: bytes):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # Aliases are refused rather than bounded: an alias makes the document a graph, nine lists
        # of nine aliases each are 9**9 values in 330 bytes ("billion laughs", a MemoryError where
        # a message printed them), and no config of the original Distribuuuu or of config/ uses one.
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"YAML alias *{event.anchor}: a config file writes each value out", event.start_mark)
        self._depth += 1
        try:
            if self._depth > _MAX_YAML_DEPTH:
                raise _Refused(f"nested more than {_MAX_YAML_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _refuse_repeated_keys(node)
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as e:  # PyYAML's constructors: "2001-13-45", an int of 5,000 digits
            raise _Refused(f"cannot read {_shown(node.value)}: {first_line(e)}", node.start_mark) from None


def _refuse_repeated_keys(node: yaml.Node, prefix: str = "") -> None:
    """Raise ``_Refused`` naming a key given twice in one mapping (PyYAML keeps the last silently) by
    its dotted path and both lines; a merge key (``<<``) too, which overrides keys as silently."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            raise _Refused("YAML merge key <<: a config file writes each key out", key_node.start_mark)
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # a list or a mapping as a key: the constructor refuses it (unhashable)
        key = f"{prefix}{_shown_key(key_node.value)}"
        if (key_node.tag, key_node.value) in seen:
            first = seen[key_node.tag, key_node.value].start_mark
            raise _Refused(f"{key} given twice ({_two_places(first, key_node.start_mark)})")
        seen[key_node.tag, key_node.value] = key_node
        _refuse_repeated_keys(value_node, key + ".")


def _two_places(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line != second.line:
        return f"lines {first.line + 1} and {second.line + 1}"
    return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"


def _configs_that_exist() -> str:
    """Name the YAML files under this checkout's config/ (as paths to type from here), for a file not found."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")
    found = sorted(
        os.path.join(root, name) for root, _, names in os.walk(folder) for name in names if name.endswith(".yaml")
    )
    shown = [p if os.path.relpath(p).startswith("..") else os.path.relpath(p) for p in found]
    return f"; the configs in this checkout: {', '.join(shown)}" if shown else ""


def _merge(config: CN, data: dict, source: str) -> None:
    """Merge nested ``data`` into ``config`` with yacs's type checks; unknown keys get a suggestion."""
    for key, value in flatten(data).items():
        if key not in _ALL_KEYS and key not in _C:  # a whole section given a value: yacs names the type
            raise ConfigError(f"{source}: {_unknown_key(key)}")
        _decode(value, f"{source}: {key}")  # what yacs's literal_eval of each string would raise, named here
    widened = _widen_ints(data, _C)
    try:
        config.merge_from_other_cfg(CN(widened))
    except (KeyError, ValueError, AssertionError) as e:
        raise ConfigError(f"{source}: {_yacs_message(e, widened, source == 'command line')}") from None


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, _ALL_KEYS, n=1, cutoff=0.6)
    return f"unknown config key {_shown_key(key)}" + (f": did you mean {close[0]}?" if close else "")


def merge_pairs(config: CN, pairs: dict[str, Any], source: str) -> None:
    """Merge flat ``KEY: value`` pairs into ``config`` (not frozen) with a config file's type checks."""
    _merge(config, _unflatten(pairs, source), source)


def _widen_ints(data: Any, defaults: Any) -> Any:
    """Ints where the default is a float become floats ("OPTIM.BASE_LR 1", "WARMUP_EPOCHS: 5"):
    yacs rejects them, and every user trips on that; every other type check stays strict."""
    if isinstance(data, dict) and isinstance(defaults, dict):
        return {k: _widen_ints(v, defaults.get(k)) for k, v in data.items()}
    if isinstance(defaults, float) and type(data) is int:
        return float(data)
    return data


# A config value is at most a few lists of paths or patterns: a longer string (a million-item
# OPTIM.STEPS, 20 s of literal_eval and deep copies here) is refused before it is read.
_MAX_VALUE_CHARS = 64 * 1024


def _decode(value: Any, key: str = "") -> Any:
    """A command-line value as Python (``0.1``, ``[1, 2]``, ``True``), or the string itself, as yacs does;
    ``key`` (with its source) names the value in a ConfigError."""
    if not isinstance(value, str):
        return value
    if len(value) > _MAX_VALUE_CHARS:
        raise ConfigError(
            f"{key}: a value of {len(value):,} characters is too long for a config value (at most 64 KiB)"
        )
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    except (RecursionError, MemoryError):  # Python's parser gives up on "-" * 3000 + "1" so, not on memory
        raise ConfigError(f"{key}: cannot read {_shown(value)}, nested too deeply") from None


def _unflatten(pairs: dict[str, Any], source: str) -> dict:
    """``{"OPTIM.BASE_LR": 0.1}`` -> ``{"OPTIM": {"BASE_LR": 0.1}}``; a key given a value and keys under it
    ("TRAIN 1 TRAIN.BATCH_SIZE 2") is a ConfigError."""
    nested: dict = {}
    for key, value in pairs.items():
        *sections, name = key.split(".")
        node = nested
        for depth, section in enumerate(sections, 1):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                section_key = ".".join(sections[:depth])
                raise ConfigError(
                    f"{source}: {_shown_key(section_key)} is given a value and keys under it ({_shown_key(key)})"
                )
        node[name] = value
    return nested


def flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """``{"TRAIN": {"BATCH_SIZE": 32}}`` -> ``{"TRAIN.BATCH_SIZE": 32}``; a CfgNode is a dict too."""
    flat: dict[str, Any] = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        flat.update(flatten(value, key + ".") if isinstance(value, dict) else {key: value})
    return flat


def config_diff(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key of ``new`` whose value differs in ``old``, sorted by key.

    Both are nested (a CfgNode or a YAML file's dict); a key ``old`` lacks has None there. A tuple
    and a list with the same items are equal: yacs keeps tuples, YAML reads lists.
    """
    before = flatten(old)
    return [(k, before.get(k), v) for k, v in sorted(flatten(new).items()) if _plain(before.get(k)) != _plain(v)]


def config_changes(saved: dict, current: dict) -> list[str]:
    """``KEY: old -> new`` for every key of ``current`` whose value differs in ``saved`` (what a resume logs)."""
    return [f"{key}: {old!r} -> {value!r}" for key, old, value in config_diff(saved, current)]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


_ALL_KEYS = list(flatten(_C))


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


# yacs's type error: "Type mismatch (<class 'float'> vs. <class 'str'>) with values (VALUES) for config
# key: KEY". Only its types and key are read: VALUES holds the whole value given, any size.
_MISMATCH = re.compile(r"Type mismatch \(<class '(?:[\w.]*\.)?(\w+)'> vs\. <class '(?:[\w.]*\.)?(\w+)'>\)")
_KEY_IN_MISMATCH = " for config key: "
# yacs's KeyError for an unknown key under which ``data`` holds an empty mapping (flatten sees none)
_NON_EXISTENT = "Non-existent config key: "


def _yacs_message(e: Exception, data: dict, command_line: bool = False) -> str:
    """Rephrase yacs's errors so they lead with the key; a string given for a list says how to write one."""
    msg = str(e.args[0] if e.args else e)
    if msg.startswith(_NON_EXISTENT):
        return _unknown_key(msg[len(_NON_EXISTENT) :])
    mismatch = _MISMATCH.match(msg)
    if not mismatch or _KEY_IN_MISMATCH not in msg:
        return _clip(msg.strip().partition("\n")[0], 300)
    want, got = mismatch.groups()
    key = msg.rpartition(_KEY_IN_MISMATCH)[2]
    value = _get(data, key)
    hint = _list_hint(key, value, command_line) if want in ("list", "tuple") and got == "str" else ""
    want = "a section of keys" if want == "CfgNode" else want
    return f"{key} expects {want}, got {type(value).__name__} {_shown(value)}{hint}"


def _list_hint(key: str, value: str, command_line: bool) -> str:
    """How to write the string ``value`` given for a list key as a list: each item quoted, in brackets."""
    items = [item.strip().strip("'\"") for item in value.strip("[]()").split(",") if item.strip()]
    as_list = _shown(items)
    if command_line:  # the shell eats brackets and quotes: the whole list is one quoted argument
        return f'; write a list on the command line as {key} "{as_list}"'
    return f"; write a list in YAML as {key.rpartition('.')[2]}: {as_list}"


# How a message shows a value the user gave: reprlib's repr, cut short, so that no message grows with
# the value (a million-item OPTIM.STEPS is named in a line, at once).
_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 12
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80
_REPR.maxlevel = 3


def _shown(value: Any) -> str:
    """``repr(value)``, at most ~100 characters."""
    return _clip(_REPR.repr(value))


def _shown_key(key: Any) -> str:
    """A key as typed, cut short; quoted and escaped if it is empty, or spaced or broken at either end."""
    key = str(key)
    return _clip(key) if key.isprintable() and key.strip() == key != "" else _shown(key)


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _choice(options: tuple) -> tuple[Callable, str]:
    return (lambda v, c: v in options), f"must be one of {options}"


def _between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> tuple[Callable, str]:
    def test(v, c) -> bool:
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)

    return test, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


# torchvision 0.29 deprecated its image decoders (TorchCodec succeeds them): data/jpeg.py takes either.
_NO_DECODE_JPEG = (
    "'batched' needs TorchCodec (pip install torchcodec) or torchvision.io.decode_jpeg, gone from this torchvision"
)


_POSITIVE = (lambda v, c: v > 0), "must be > 0"
_NON_NEGATIVE = (lambda v, c: v >= 0), "must be >= 0"
_AT_LEAST_1 = (lambda v, c: v >= 1), "must be >= 1"
_PROBABILITY = _between(0, 1)
_STRINGS = (lambda v, c: all(isinstance(s, str) and s for s in v)), "must be a list of non-empty strings"

# Every rule: (key, (test(value, config) -> bool, what the value must be)). The first failing
# rule raises ConfigError("KEY what, got VALUE"). Rules that read other keys say so in their text.
_RULES: list[tuple[str, tuple[Callable, str]]] = [
    ("TRAIN.BATCH_SIZE", _POSITIVE),
    ("TEST.BATCH_SIZE", _POSITIVE),
    ("TRAIN.IM_SIZE", _POSITIVE),
    ("TEST.CROP_SIZE", _NON_NEGATIVE),
    ("TEST.IM_SIZE", ((lambda v, c: c.TEST.CROP_PCT > 0 or v >= eval_crop_size(c)),
                      "must be >= TEST.CROP_SIZE (0: TRAIN.IM_SIZE)")),
    ("TEST.CROP_PCT", _between(0, 1)),
    ("TEST.INTERPOLATION", _choice(INTERPOLATIONS)),
    ("TEST.EXTRA_DATASETS", ((lambda v, c: all(isinstance(d, str) and d for d in v)), "must be a list of dataset roots")),
    ("MODEL.NUM_CLASSES", _POSITIVE),
    ("MODEL.TASK", _choice(TASKS)),
    ("TEST.THRESHOLD", _between(0, 1, lo_open=True, hi_open=True)),
    ("TEST.AP_BINS", ((lambda v, c: 2 <= v <= 2**20), "must be in 2..1048576")),
    ("DATA.ANN_LABEL_SEP", ((lambda v, c: v != "" and v != "\n"), "must be a separator such as ' ', ';' or '|'")),
    ("MODEL.TASK", ((lambda v, c: v == "multiclass" or c.TRAIN.SAMPLER != "weighted"),
                    "multilabel cannot draw classes equally often (TRAIN.SAMPLER weighted): a sample has "
                    "several; set TRAIN.SAMPLER default or TRAIN.CLASS_WEIGHTS balanced (positive weights)")),
    ("MODEL.TASK", ((lambda v, c: v == "multiclass" or not (c.TEST.CONFUSION or c.TEST.SAVE_PREDICTIONS)),
                    "multilabel has no confusion matrix or top-k predictions file: set TEST.CONFUSION and "
                    "TEST.SAVE_PREDICTIONS False")),
    ("DISTILL.TEACHER", ((lambda v, c: not v or c.MODEL.TASK == "multiclass"),
                         "distils a softmax over one label per image (KL between the teacher's and the "
                         "student's class distributions): MODEL.TASK multilabel has none; set DISTILL.TEACHER ''")),
    ("TRAIN.TOPK", ((lambda v, c: 1 <= v <= c.MODEL.NUM_CLASSES), "must be in 1..MODEL.NUM_CLASSES")),
    ("TRAIN.PRINT_FREQ", _POSITIVE),
    ("TEST.PRINT_FREQ", _POSITIVE),
    ("TRAIN.WORKERS", _NON_NEGATIVE),
    ("TRAIN.PREFETCH_FACTOR", _POSITIVE),
    ("TRAIN.ACCUM_STEPS", _AT_LEAST_1),
    ("TRAIN.PRECISION", _choice(PRECISIONS)),
    ("TRAIN.CLIP_GRAD_NORM", _NON_NEGATIVE),
    ("TRAIN.LABEL_SMOOTHING", _between(0, 1, hi_open=True)),
    ("TRAIN.LOSS", ((lambda v, c: v in _loss_names()), lambda: f"must be one of {_loss_names()}")),
    ("TRAIN.BCE_TARGET_THRESHOLD", _between(0, 1, hi_open=True)),
    ("TRAIN.CLASS_WEIGHTS", _choice(("none", "balanced"))),
    ("TRAIN.SAMPLER", _choice(SAMPLERS)),
    ("TRAIN.BEST_METRIC", _choice(tuple(BEST_METRICS))),
    ("TRAIN.BEST_METRIC", ((lambda v, c: v in ("top1", "loss") or c.MODEL.TASK == "multilabel"),
                           "map and f1_macro are multi-label metrics: set MODEL.TASK multilabel, or "
                           "TRAIN.BEST_METRIC top1 or loss")),
    ("TRAIN.REPEATED_AUG", _AT_LEAST_1),
    ("TRAIN.NAN_POLICY", _choice(("stop", "skip"))),
    ("TRAIN.CKPT_PERIOD_ITERS", _NON_NEGATIVE),
    ("TRAIN.KEEP_CKPTS", _AT_LEAST_1),
    ("TRAIN.EVAL_PERIOD", _AT_LEAST_1),
    ("TRAIN.STOP_AFTER_EPOCHS", _NON_NEGATIVE),
    ("TRAIN.PROGRESSIVE_SIZE_MULTIPLE", _AT_LEAST_1),
    ("TRAIN.PROGRESSIVE_START_SIZE", _NON_NEGATIVE),
    ("TRAIN.PROGRESSIVE_START_SIZE", ((lambda v, c: v == 0 or (v % c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE == 0
                                                                and v <= c.TRAIN.IM_SIZE)),
                                      "must be 0 (off) or a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE no larger "
                                      "than TRAIN.IM_SIZE (where the ramp ends)")),
    ("TRAIN.PROGRESSIVE_START_SIZE", ((lambda v, c: v == 0 or not c.MODEL.DUMMY_INPUT),
                                      "needs real images (MODEL.DUMMY_INPUT's are made at TRAIN.IM_SIZE, with no "
                                      "transform to resize them): set TRAIN.PROGRESSIVE_START_SIZE 0")),
    ("TRAIN.IM_SIZE", ((lambda v, c: not c.TRAIN.PROGRESSIVE_START_SIZE or v % c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE == 0),
                       "must be a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE with progressive resizing (the ramp "
                       "ends there)")),
    ("TRAIN.PROGRESSIVE_START_EPOCH", _NON_NEGATIVE),
    # Not bounded by OPTIM.MAX_EPOCH: test_net.py takes these keys from a checkpoint but not
    # MAX_EPOCH (a runtime key), and a shortened run may stop inside the ramp (the run logs it).
    ("TRAIN.PROGRESSIVE_END_EPOCH", ((lambda v, c: not c.TRAIN.PROGRESSIVE_START_SIZE
                                      or v > c.TRAIN.PROGRESSIVE_START_EPOCH),
                                     "must be above TRAIN.PROGRESSIVE_START_EPOCH with progressive resizing (FFCV's "
                                     "end_ramp: the first epoch, from 0, at TRAIN.IM_SIZE)")),
    ("MODEL.WEIGHTS_KIND", _choice(("model", "ema"))),
    ("MODEL.KWARGS", ((lambda v, c: _kwargs_ok(v)), 'must be a list of "name=value" strings')),
    ("MODEL.FREEZE", _STRINGS),
    ("MODEL.PRETRAINED_WEIGHTS", ((lambda v, c: re.fullmatch(r"[\w.]*", v) is not None),
                                  'must be a weight name such as "IMAGENET1K_V2" or "a1_in1k"')),
    ("DATA.MEAN", ((lambda v, c: len(v) == 3), "must have 3 values")),
    ("DATA.STD", ((lambda v, c: len(v) == 3 and all(s > 0 for s in v)), "must be 3 values > 0")),
    ("DATA.CROP_SCALE_MIN", _between(0, 1, lo_open=True)),
    ("DATA.HFLIP_PROB", _PROBABILITY),
    ("DATA.AUTO_AUGMENT", _choice(AUTO_AUGMENTS)),
    ("DATA.RANDOM_ERASING", _PROBABILITY),
    ("DATA.MIXUP_ALPHA", _NON_NEGATIVE),
    ("DATA.CUTMIX_ALPHA", _NON_NEGATIVE),
    ("DATA.MIX_PROB", _PROBABILITY),
    ("DATA.MIX_SWITCH_PROB", _PROBABILITY),
    ("DATA.BAD_IMAGE", _choice(("error", "skip"))),
    ("DATA.DECODER", _choice(DECODERS)),
    ("DATA.MAX_IMAGE_PIXELS", ((lambda v, c: v >= 0), "must be >= 0 (0: no limit)")),
    ("DATA.DECODER", ((lambda v, c: v != "batched" or _has_decode_jpeg()), _NO_DECODE_JPEG)),
    ("DATA.DUMMY_SIZE", _POSITIVE),
    ("DATA.SHUFFLE_WINDOW", _NON_NEGATIVE),
    ("DATA.SHUFFLE_WINDOW", ((lambda v, c: v == 0 or c.TRAIN.SAMPLER == "default"),
                             "needs TRAIN.SAMPLER default (the repeated and weighted samplers draw their own "
                             "order): set DATA.SHUFFLE_WINDOW 0")),
    ("DATA.SHARD_CACHE_LIMIT", _NON_NEGATIVE),
    ("DATA.SHARD_CACHE_LIMIT", ((lambda v, c: v == 0 or c.DATA.SHUFFLE_WINDOW > 0),
                                "needs DATA.SHUFFLE_WINDOW > 0 (a global permutation reads every shard at once): "
                                "set DATA.SHUFFLE_WINDOW or DATA.SHARD_CACHE_LIMIT 0")),
    ("DATA.SHARD_PREFETCH", _NON_NEGATIVE),
    ("OPTIM.OPTIMIZER", _choice(OPTIMIZERS)),
    ("OPTIM.MAX_EPOCH", _POSITIVE),
    ("OPTIM.LR_POLICY", _choice(LR_POLICIES)),
    ("OPTIM.BASE_LR", _POSITIVE),
    ("OPTIM.MIN_LR", ((lambda v, c: 0 <= v <= c.OPTIM.BASE_LR), "must be in [0, OPTIM.BASE_LR]")),
    ("OPTIM.STEPS", ((lambda v, c: _ascending_positive(v)), "must be a list of ascending positive epochs")),
    ("OPTIM.LR_MULT", _POSITIVE),
    ("OPTIM.MOMENTUM", _NON_NEGATIVE),
    ("OPTIM.DAMPENING", _between(0, 1, hi_open=True)),
    ("OPTIM.NESTEROV", ((lambda v, c: not (v and c.OPTIM.OPTIMIZER == "sgd" and not _nesterov_ok(c.OPTIM))),
                        "needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING == 0")),
    ("OPTIM.WARMUP_FACTOR", _between(0, 1, lo_open=True)),
    ("OPTIM.WARMUP_EPOCHS", ((lambda v, c: 0 <= v <= c.OPTIM.MAX_EPOCH), "must be in [0, OPTIM.MAX_EPOCH]")),
    ("OPTIM.WEIGHT_DECAY", _NON_NEGATIVE),
    ("OPTIM.NO_WEIGHT_DECAY", _STRINGS),
    ("OPTIM.HEAD_LR_MULT", _POSITIVE),
    ("OPTIM.LAYER_DECAY", _between(0, 1)),
    ("OPTIM.BETAS", ((lambda v, c: len(v) == 2 and all(0 <= b < 1 for b in v)), "must be two values in [0, 1)")),
    ("OPTIM.LARS_TRUST", _POSITIVE),
    ("OPTIM.REFERENCE_BATCH", _NON_NEGATIVE),
    ("OPTIM.EMA_DECAY", _between(0, 1, hi_open=True)),
    ("OPTIM.EMA_PERIOD", _AT_LEAST_1),
    ("DIST.BACKEND", _choice(("", "nccl", "gloo"))),
    ("DIST.TIMEOUT_S", _POSITIVE),
    ("DIST.STALL_S", _NON_NEGATIVE),
    ("DIST.STALL_S", ((lambda v, c: v < c.DIST.TIMEOUT_S), "must be below DIST.TIMEOUT_S (0: half of it)")),
    ("DIST.INIT_CHECK_TIMEOUT_S", _POSITIVE),
    ("DIST.BUCKET_CAP_MB", _POSITIVE),
    ("DIST.PREEMPT_GRACE_S", _POSITIVE),
    ("DIST.LOCK_STALE_S", _POSITIVE),
    ("DIST.LOCK_WAIT_S", _NON_NEGATIVE),
    ("DIST.COMM_HOOK", _choice(COMM_HOOKS)),
    ("DIST.STRATEGY", _choice(STRATEGIES)),
    ("DIST.STRATEGY", ((lambda v, c: v == "ddp" or not c.OPTIM.ZERO),
                       "fsdp/hsdp cannot combine with OPTIM.ZERO True (ZeRO-1 is for ddp; fsdp shards the "
                       "optimizer state itself): set OPTIM.ZERO False")),
    ("DIST.STRATEGY", ((lambda v, c: v == "ddp" or not c.DIST.COMM_HOOK),
                       "fsdp/hsdp cannot combine with DIST.COMM_HOOK (a DDP gradient hook): set DIST.COMM_HOOK "
                       "'' (fsdp reduce-scatters in fp32 under TRAIN.PRECISION bf16/fp16)")),
    ("DIST.CKPT_FORMAT", _choice(CKPT_FORMATS)),
    ("DIST.CKPT_FORMAT", ((lambda v, c: v != "file" or c.DIST.STRATEGY == "ddp"),
                          "file would gather the whole sharded model on one rank under DIST.STRATEGY fsdp/hsdp: "
                          "set DIST.CKPT_FORMAT '' (sharded) and convert with tools/convert_checkpoint.py")),
    ("DIST.CKPT_FORMAT", ((lambda v, c: v != "sharded" or not c.OPTIM.ZERO),
                          "sharded cannot save OPTIM.ZERO's optimizer (ZeRO-1 consolidates into one file): "
                          "set DIST.CKPT_FORMAT '' or OPTIM.ZERO False")),
    ("DISTILL.ARCH", ((lambda v, c: not v or c.DISTILL.TEACHER), "needs DISTILL.TEACHER (the teacher's weights)")),
    ("DISTILL.WEIGHTS_KIND", _choice(("model", "ema"))),
    ("DISTILL.ALPHA", _between(0, 1)),
    ("DISTILL.TEMPERATURE", _POSITIVE),
    ("DISTILL.SHARD_TEACHER", ((lambda v, c: not v or c.DIST.STRATEGY != "ddp"),
                               "needs DIST.STRATEGY fsdp or hsdp (ddp replicates the teacher)")),
    ("BN.PRECISE_IMAGES", _NON_NEGATIVE),
    ("BN.PRECISE_IMAGES", ((lambda v, c: v == 0 or not c.MODEL.SYNCBN),
                           "cannot combine with MODEL.SYNCBN True (SyncBatchNorm all-reduces each batch, and "
                           "ranks hold different numbers of batches): set BN.PRECISE_IMAGES 0")),
    ("BN.PRECISE_IMAGES", ((lambda v, c: v == 0 or c.DIST.STRATEGY == "ddp"),
                           "needs DIST.STRATEGY ddp (a sharded model all-gathers in each forward, and ranks "
                           "hold different numbers of batches): set BN.PRECISE_IMAGES 0")),
    ("BN.PRECISE_TRANSFORM", _choice(("train", "val"))),
    ("OUT_DIR", ((lambda v, c: bool(v)), "must not be empty")),
    ("CFG_DEST", ((lambda v, c: bool(v) and os.sep not in v), "must be a file name")),
    ("LOG.TRACKERS", ((lambda v, c: all(t in TRACKERS for t in v) and len(set(v)) == len(v)),
                      f"must be a list of distinct names from {TRACKERS}")),
    ("LOG.PROJECT", ((lambda v, c: bool(v)), "must not be empty")),
    ("LOG.WANDB_MODE", _choice(("offline", "online"))),
]  # fmt: skip


def validate_cfg(c: CN) -> None:
    """Raise ConfigError naming the first key whose number is not finite or whose value breaks its rule."""
    _check_numbers(c)
    for key, (test, what) in _RULES:
        value = _get(c, key)
        if not test(value, c):
            raise ConfigError(f"{key} {what() if callable(what) else what}, got {_shown(value)}")


def _check_numbers(c: CN) -> None:
    """One rule for every key, before the per-key ones: a float is finite (yacs reads "1e999" as inf,
    YAML ".nan" as nan, and both pass "> 0"), and a list whose default holds numbers (DATA.MEAN,
    OPTIM.BETAS, OPTIM.STEPS) holds finite numbers."""
    for key, value in flatten(c).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be finite, got {_shown(value)}")
        if key in _NUMBER_LISTS and not all(_is_finite_number(v) for v in value):
            raise ConfigError(f"{key} must hold finite numbers, got {_shown(value)}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The list keys (DATA.MEAN, DATA.STD, OPTIM.STEPS, OPTIM.BETAS) whose defaults hold numbers
_NUMBER_LISTS = frozenset(
    k for k, v in flatten(_C).items() if isinstance(v, (list, tuple)) and v and all(_is_finite_number(x) for x in v)
)


def _get(c: dict, key: str) -> Any:
    for part in key.split("."):
        c = c[part]
    return c


def eval_crop_size(c: CN) -> int:
    """The evaluation center-crop size: TEST.CROP_SIZE, or TRAIN.IM_SIZE when it is 0."""
    return c.TEST.CROP_SIZE or c.TRAIN.IM_SIZE


def parse_model_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """MODEL.KWARGS ``["drop_path_rate=0.1", "norm=batch"]`` -> ``{"drop_path_rate": 0.1, "norm": "batch"}``.

    Values are Python literals (numbers, True/None, lists) or else the string itself, as on the
    command line.
    """
    kwargs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ConfigError(f'MODEL.KWARGS entries must be "name=value" strings, got {_shown(item)}')
        kwargs[name.strip()] = _decode(value.strip(), "MODEL.KWARGS")
    return kwargs


def _kwargs_ok(items: Sequence[str]) -> bool:
    try:
        parse_model_kwargs(items)
    except (ConfigError, TypeError, AttributeError):
        return False
    return True


def _ascending_positive(steps: list) -> bool:
    numbers = all(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 for s in steps)
    return numbers and list(steps) == sorted(steps)


def _nesterov_ok(o: CN) -> bool:
    return o.MOMENTUM > 0 and o.DAMPENING == 0


def _loss_names() -> tuple[str, ...]:
    """TRAIN.LOSS's names: the losses' own registry (``losses.LOSSES``), imported only to validate a
    config (it imports torch; a tool that only reads the config stays light)."""
    from distribuuuu.losses import LOSSES

    return tuple(LOSSES)


def _has_decode_jpeg() -> bool:
    import importlib.util

    import torchvision.io  # only here: the config module stays light for tools that only read it

    return importlib.util.find_spec("torchcodec") is not None or hasattr(torchvision.io, "decode_jpeg")


def changes_from_defaults(config: dict) -> list[tuple[str, Any, Any]]:
    """(key, default, value) for every key of ``config`` (a CfgNode, or a config.yaml's dict) that
    differs from the defaults: what a run summary lists."""
    return config_diff(get_cfg_defaults(), config)


def run_config_changes(out_dir: str, cfg_dest: str = "config.yaml") -> list[tuple[str, Any, Any]]:
    """``changes_from_defaults`` of the config a run kept in OUT_DIR (none without one)."""
    path = os.path.join(out_dir, cfg_dest)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return changes_from_defaults(yaml.safe_load(f) or {})


def dump_cfg(c: CN, out_dir: str) -> str:
    """Write the config as YAML to OUT_DIR/CFG_DEST and return its path."""
    path = os.path.join(out_dir, c.CFG_DEST)
    with open(path, "w") as f:
        f.write(c.dump())
    return path
