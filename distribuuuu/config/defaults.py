"""Every config key with its default and a one-line comment (the config reference is generated from
these comments: tools/config_reference.py), and the values the choice keys take.

The keys of the original Distribuuuu keep their names and meaning, so its YAML files load
unchanged. The defaults train a small torchvision model on the embedded ``data/digits`` set.
"""

from __future__ import annotations

from yacs.config import CfgNode as CN

_C = CN()

# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
_C.MODEL = CN()
# Architecture: a torchvision classification model name, a timm name (if timm is installed), or a
# name registered with distribuuuu.models.register_model
_C.MODEL.ARCH = "resnet18"
# Number of output classes; 0: the training data's count (class folders, annotation labels, a packed
# index, a Hugging Face ClassLabel), said in the log and stored with the run's config
_C.MODEL.NUM_CLASSES = 0
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
# Activation checkpointing of the repeated blocks (models.find_blocks: the ones FSDP wraps): "none",
# "full" (every block: least memory, one more forward of the blocks a step) or "selective" (every
# MODEL.ACTIVATION_CHECKPOINTING_EVERY-th block); non-reentrant, BatchNorm statistics updated once
# (docs/performance.md#activation-checkpointing)
_C.MODEL.ACTIVATION_CHECKPOINTING = "none"
# "selective": checkpoint blocks k, 2k, 3k, ... (from 1) for this k (torchtitan's per-layer selective)
_C.MODEL.ACTIVATION_CHECKPOINTING_EVERY = 2
# The original key: True is MODEL.ACTIVATION_CHECKPOINTING full
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
# How many of the newest checkpoints to keep in OUT_DIR/checkpoints (best.pth.tar is kept apart); 1:
# the one a resume takes, a file read back and verified before the previous one goes (docs/out-dir.md)
_C.TRAIN.KEEP_CKPTS = 1
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
# The ramp's sizes are multiples of this (FFCV: 32; 8 for 32 px images, docs/recipe.md);
# PROGRESSIVE_START_SIZE and TRAIN.IM_SIZE must be too
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
# MODEL.TASK multilabel: a class is predicted when its sigmoid score is at least this, in [0, 1]
# (F1, precision, recall; predict.py marks these classes)
_C.TEST.THRESHOLD = 0.5
# MODEL.TASK multilabel: the score quantisation of the exact mAP, levels per class spread over
# each class's observed logit range; the counts take 8 x MODEL.NUM_CLASSES x AP_BINS bytes on each
# rank, beside its own share of the logits (docs/annotations.md)
_C.TEST.AP_BINS = 4096
# Center-crop size of evaluation (0: TRAIN.IM_SIZE)
_C.TEST.CROP_SIZE = 0
# Crop ratio: if > 0, resize to crop size / CROP_PCT instead of TEST.IM_SIZE (timm's crop_pct;
# 0.875 is ImageNet's 256 -> 224); 0 with a pretrained timm model takes the model's own
_C.TEST.CROP_PCT = 0.0
# Resize interpolation of evaluation: "bilinear", "bicubic" or "nearest" ("": bilinear, or a
# pretrained timm model's own)
_C.TEST.INTERPOLATION = ""
# Test-time augmentation of every evaluation: "" (none) or "flip" (the mean of the logits of each
# image and of its horizontal flip, one forward of both; timm's --tta averages logits too)
_C.TEST.TTA = ""
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
# Automatic augmentation policy: "", "randaugment", "trivialaugment", "autoaugment" or "threeaugment"
# (DeiT III's 3-Augment: one of grayscale, solarization, Gaussian blur per image, then DATA.COLOR_JITTER)
_C.DATA.AUTO_AUGMENT = ""
# Colour jitter (brightness, contrast, saturation factors in 1 +- this) after DATA.AUTO_AUGMENT
# threeaugment's operation (DeiT III: 0.3; 0: none); the other policies take none
_C.DATA.COLOR_JITTER = 0.3
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
# DATA.DECODER batched: the share of the device's memory its batched resample may hold at once; a
# batch whose crops need more is resampled in chunks that fit (256 crops of 12 MP photos: ~20 GB
# unchunked), and a chunk that still runs out of memory is retried in halves (docs/gpu.md)
_C.DATA.BATCHED_MEMORY_BUDGET = 0.05
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
# Folder that keeps each split folder's index (its listing) between jobs, written by global rank 0,
# read back when none of the split's folders changed since (their mtimes): a job then lists nothing
# ("": every job lists each split once, on rank 0; docs/performance.md, "The dataset index")
_C.DATA.INDEX_CACHE = ""
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
# Optimizer: "sgd", "adamw", "lars", "lamb" or "muon" (torch.optim.Muon on the hidden 2-D weight matrices,
# AdamW with OPTIM.BETAS on biases, norms, embeddings, convolution kernels and the head; docs/recipe.md#recipes-for-larger-jobs)
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
# Muon's momentum (OPTIM.OPTIMIZER muon; Nesterov's with OPTIM.NESTEROV)
_C.OPTIM.MUON_MOMENTUM = 0.95
# Muon's LR per matrix shape (A, B): "match_rms_adamw" (Moonshot: x 0.2 sqrt(max(A, B)), so BASE_LR and
# WEIGHT_DECAY are AdamW's for both), "original" (Keller Jordan: x sqrt(max(1, A / B))) or "spectral_unclamped"
_C.OPTIM.MUON_ADJUST_LR = "match_rms_adamw"
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
# A requeued or restarted job (SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT or, on Kubernetes,
# JOBSET_RESTART_ATTEMPT > 0) waits this many seconds for its predecessor to let go of OUT_DIR; a first
# start stops at once
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
# Peak TFLOP/s of one device, for the model FLOPs utilisation (MFU) in the log, metrics.jsonl and
# TensorBoard (e.g. 989 for an H100's dense bf16; 0: no MFU, the achieved TFLOP/s alone)
_C.LOG.PEAK_TFLOPS = 0.0
# Warn, naming rank and host, when a rank is this many median steps behind the others at a sync point
# (its step time, or its data wait, the others wait for in the gradient all-reduce; 0: never)
_C.LOG.STRAGGLER_FACTOR = 1.5
# Draw OUT_DIR/metrics.png at the end of training (~1 s of one core, with matplotlib); False: summary.md
# without it, for sweeps of short runs (tools/plot_metrics.py OUT_DIR draws it at any time)
_C.LOG.PLOT = True

PRECISIONS = ("fp32", "bf16", "fp16")
LR_POLICIES = ("cos", "steps", "lin")
OPTIMIZERS = ("sgd", "adamw", "lars", "lamb", "muon")
MUON_ADJUST_LRS = ("original", "match_rms_adamw", "spectral_unclamped")
INTERPOLATIONS = ("", "bilinear", "bicubic", "nearest")
TTAS = ("", "flip")
SAMPLERS = ("default", "repeated", "weighted")
TASKS = ("multiclass", "multilabel")
CHECKPOINTING_MODES = ("none", "full", "selective")
# TRAIN.BEST_METRIC: each metric's metrics.jsonl field and whether a lower value is better
BEST_METRICS = {"top1": ("top1", False), "map": ("map", False), "f1_macro": ("f1_macro", False), "loss": ("loss", True)}
AUTO_AUGMENTS = ("", "randaugment", "trivialaugment", "autoaugment", "threeaugment")
COMM_HOOKS = ("", "fp16", "bf16")
STRATEGIES = ("ddp", "fsdp", "hsdp")
CKPT_FORMATS = ("", "sharded", "file")
DECODERS = ("auto", "pil", "torchvision", "batched", "draft")
TRACKERS = ("wandb", "mlflow")


def get_cfg_defaults() -> CN:
    """Return a fresh copy of the default config."""
    return _C.clone()
