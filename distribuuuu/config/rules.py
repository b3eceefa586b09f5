"""Every key's rule, and the validation that applies them: the first value that breaks its rule is a
ConfigError naming the key ("TRAIN.BATCH_SIZE must be > 0, got -1"), never an assert."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any, Callable

from yacs.config import CfgNode as CN

from distribuuuu.config.defaults import (
    _C,
    AUTO_AUGMENTS,
    BEST_METRICS,
    CHECKPOINTING_MODES,
    CKPT_FORMATS,
    COMM_HOOKS,
    DECODERS,
    INTERPOLATIONS,
    LR_POLICIES,
    MUON_ADJUST_LRS,
    OPTIMIZERS,
    PRECISIONS,
    SAMPLERS,
    STRATEGIES,
    TASKS,
    TRACKERS,
    TTAS,
)
from distribuuuu.config.keys import flatten, get_key
from distribuuuu.config.values import decode, shown
from distribuuuu.errors import ConfigError


def _choice(options: tuple) -> tuple[Callable, str]:
    return (lambda v, c: v in options), f"must be one of {options}"


def _between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> tuple[Callable, str]:
    def test(v, c) -> bool:
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)

    return test, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


_POSITIVE = (lambda v, c: v > 0), "must be > 0"
_NON_NEGATIVE = (lambda v, c: v >= 0), "must be >= 0"
_AT_LEAST_1 = (lambda v, c: v >= 1), "must be >= 1"
_PROBABILITY = _between(0, 1)
_STRINGS = (lambda v, c: all(isinstance(s, str) and s for s in v)), "must be a list of non-empty strings"

# Every rule: (key, (test(value, config) -> bool, what the value must be)). The first failing
# rule raises ConfigError("KEY what, got VALUE"). Rules that read other keys say so in their text;
# where it names their values, ``what`` is a function (value, config) of the whole text after KEY.
_RULES: list[tuple[str, tuple[Callable, str | Callable]]] = [
    ("TRAIN.BATCH_SIZE", _POSITIVE),
    ("TEST.BATCH_SIZE", _POSITIVE),
    ("TRAIN.IM_SIZE", _POSITIVE),
    ("TEST.CROP_SIZE", _NON_NEGATIVE),
    ("TEST.IM_SIZE", ((lambda v, c: c.TEST.CROP_PCT > 0 or v >= (c.TEST.CROP_SIZE or c.TRAIN.IM_SIZE)),
                      "must be >= TEST.CROP_SIZE (0: TRAIN.IM_SIZE)")),
    ("TEST.CROP_PCT", _between(0, 1)),
    ("TEST.INTERPOLATION", _choice(INTERPOLATIONS)),
    ("TEST.TTA", _choice(TTAS)),
    ("TEST.EXTRA_DATASETS", ((lambda v, c: all(isinstance(d, str) and d for d in v)), "must be a list of dataset roots")),
    ("MODEL.NUM_CLASSES", ((lambda v, c: v >= 0), "must be >= 0 (0: the training data's class count)")),
    ("MODEL.TASK", _choice(TASKS)),
    ("TEST.THRESHOLD", _between(0, 1)),  # 0: every class predicted; 1: scores that round to 1
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
    # MODEL.NUM_CLASSES 0 (the data's count): the run lowers TRAIN.TOPK to that count (training/class_count.py)
    ("TRAIN.TOPK", ((lambda v, c: 1 <= v and (c.MODEL.NUM_CLASSES == 0 or v <= c.MODEL.NUM_CLASSES)),
                    "must be in 1..MODEL.NUM_CLASSES")),
    ("TRAIN.PRINT_FREQ", _POSITIVE),
    ("TEST.PRINT_FREQ", _POSITIVE),
    ("TRAIN.WORKERS", _NON_NEGATIVE),
    ("TRAIN.PREFETCH_FACTOR", _POSITIVE),
    ("TRAIN.ACCUM_STEPS", _AT_LEAST_1),
    ("TRAIN.PRECISION", _choice(PRECISIONS)),
    ("TRAIN.CLIP_GRAD_NORM", _NON_NEGATIVE),
    ("TRAIN.LABEL_SMOOTHING", _between(0, 1, hi_open=True)),
    ("TRAIN.LOSS", ((lambda v, c: v in _loss_names()), lambda v, c: f"must be one of {_loss_names()}, got {shown(v)}")),
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
                                      lambda v, c: (
                                          f"must be 0 (off) or a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE "
                                          f"({c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE}) no larger than TRAIN.IM_SIZE "
                                          f"({c.TRAIN.IM_SIZE}, where the ramp ends), got {shown(v)}"
                                          + _fitting_multiple(v, c.TRAIN.IM_SIZE, c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE)))),
    ("TRAIN.PROGRESSIVE_START_SIZE", ((lambda v, c: v == 0 or not c.MODEL.DUMMY_INPUT),
                                      "needs real images (MODEL.DUMMY_INPUT's are made at TRAIN.IM_SIZE, with no "
                                      "transform to resize them): set TRAIN.PROGRESSIVE_START_SIZE 0")),
    ("TRAIN.IM_SIZE", ((lambda v, c: not c.TRAIN.PROGRESSIVE_START_SIZE or v % c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE == 0),
                       lambda v, c: (
                           f"must be a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE ({c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE}) "
                           f"with progressive resizing (the ramp ends there), got {shown(v)}"
                           + _fitting_multiple(c.TRAIN.PROGRESSIVE_START_SIZE, v, c.TRAIN.PROGRESSIVE_SIZE_MULTIPLE)))),
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
    ("MODEL.ACTIVATION_CHECKPOINTING", _choice(CHECKPOINTING_MODES)),
    ("MODEL.ACTIVATION_CHECKPOINTING_EVERY", _AT_LEAST_1),
    ("MODEL.GRAD_CHECKPOINT", ((lambda v, c: not v or c.MODEL.ACTIVATION_CHECKPOINTING in ("none", "full")),
                               "must be False with MODEL.ACTIVATION_CHECKPOINTING selective (True is the original "
                               "key for full)")),
    ("MODEL.PRETRAINED_WEIGHTS", ((lambda v, c: re.fullmatch(r"[\w.]*", v) is not None),
                                  'must be a weight name such as "IMAGENET1K_V2" or "a1_in1k"')),
    ("DATA.MEAN", ((lambda v, c: len(v) == 3), "must have 3 values")),
    ("DATA.STD", ((lambda v, c: len(v) == 3 and all(s > 0 for s in v)), "must be 3 values > 0")),
    ("DATA.CROP_SCALE_MIN", _between(0, 1, lo_open=True)),
    ("DATA.HFLIP_PROB", _PROBABILITY),
    ("DATA.AUTO_AUGMENT", _choice(AUTO_AUGMENTS)),
    ("DATA.COLOR_JITTER", _NON_NEGATIVE),
    ("DATA.RANDOM_ERASING", _PROBABILITY),
    ("DATA.MIXUP_ALPHA", _NON_NEGATIVE),
    ("DATA.CUTMIX_ALPHA", _NON_NEGATIVE),
    ("DATA.MIX_PROB", _PROBABILITY),
    ("DATA.MIX_SWITCH_PROB", _PROBABILITY),
    ("DATA.BAD_IMAGE", _choice(("error", "skip"))),
    ("DATA.DECODER", _choice(DECODERS)),
    ("DATA.MAX_IMAGE_PIXELS", ((lambda v, c: v >= 0), "must be >= 0 (0: no limit)")),
    ("DATA.BATCHED_MEMORY_BUDGET", _between(0, 1, lo_open=True)),
    ("DATA.DUMMY_SIZE", _POSITIVE),
    ("DATA.INDEX_CACHE", ((lambda v, c: not v or ("://" not in v and not os.path.isfile(v))),
                          "must be a local folder (or '' for none), not a file or a URL")),
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
    ("OPTIM.MUON_MOMENTUM", _between(0, 1, hi_open=True)),
    ("OPTIM.MUON_ADJUST_LR", _choice(MUON_ADJUST_LRS)),
    ("OPTIM.ZERO", ((lambda v, c: not v or c.OPTIM.OPTIMIZER != "muon"),
                    "cannot combine with OPTIM.OPTIMIZER muon (ZeroRedundancyOptimizer rebuilds the optimizer from "
                    "bare parameter lists, losing which go to Muon): set OPTIM.ZERO False")),
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
    ("LOG.PEAK_TFLOPS", _NON_NEGATIVE),
    ("LOG.STRAGGLER_FACTOR", ((lambda v, c: v == 0 or v > 1), "must be 0 (off) or above 1 (median steps behind)")),
]  # fmt: skip


def validate_cfg(c: CN) -> None:
    """Raise ConfigError naming the first key whose number is not finite or whose value breaks its rule."""
    _check_numbers(c)
    for key, (test, what) in _RULES:
        value = get_key(c, key)
        if not test(value, c):
            raise ConfigError(f"{key} {what(value, c) if callable(what) else f'{what}, got {shown(value)}'}")


def _fitting_multiple(start: int, end: int, multiple: int) -> str:
    """Which TRAIN.PROGRESSIVE_SIZE_MULTIPLE would fit a ramp from ``start`` to ``end`` px, when
    ``multiple`` does not: their greatest common divisor (or any divisor of it)."""
    if not 0 < start <= end or (start % multiple == 0 and end % multiple == 0):
        return ""
    fits = math.gcd(start, end)
    return f": TRAIN.PROGRESSIVE_SIZE_MULTIPLE {fits} (or a divisor of it) fits a ramp from {start} to {end} px"


def _check_numbers(c: CN) -> None:
    """One rule for every key, before the per-key ones: a float is finite (yacs reads "1e999" as inf,
    YAML ".nan" as nan, and both pass "> 0"), and a list whose default holds numbers (DATA.MEAN,
    OPTIM.BETAS, OPTIM.STEPS) holds finite numbers."""
    for key, value in flatten(c).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be finite, got {shown(value)}")
        if key in _NUMBER_LISTS and not all(_is_finite_number(v) for v in value):
            raise ConfigError(f"{key} must hold finite numbers, got {shown(value)}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The list keys (DATA.MEAN, DATA.STD, OPTIM.STEPS, OPTIM.BETAS) whose defaults hold numbers
_NUMBER_LISTS = frozenset(
    k for k, v in flatten(_C).items() if isinstance(v, (list, tuple)) and v and all(_is_finite_number(x) for x in v)
)


def parse_model_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """MODEL.KWARGS ``["drop_path_rate=0.1", "norm=batch"]`` -> ``{"drop_path_rate": 0.1, "norm": "batch"}``.

    Values are Python literals (numbers, True/None, lists) or else the string itself, as on the
    command line.
    """
    kwargs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ConfigError(f'MODEL.KWARGS entries must be "name=value" strings, got {shown(item)}')
        kwargs[name.strip()] = decode(value.strip(), "MODEL.KWARGS")
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
