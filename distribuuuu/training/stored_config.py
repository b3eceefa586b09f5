"""The config a checkpoint's run stored, read back: which keys make another experiment, the tools'
config rebuilt from it (test_net.py, predict.py, export.py), and the key to change when the weights
do not fit a config."""

from __future__ import annotations

import os
from collections.abc import Sequence

from yacs.config import CfgNode

from distribuuuu.checkpointing.checkpoint import load_checkpoint, named_by
from distribuuuu.checkpointing.names import CKPT_DIR, FILE, SHARDED
from distribuuuu.config import flatten, get_cfg_defaults, keys_given, load_cfg, merge_pairs, stored_config
from distribuuuu.training.class_count import LEGACY_CLASSES

# Keys that make another experiment: resuming a checkpoint trained with other values would mix
# two runs in one OUT_DIR (and one record). TRAIN.RESUME_ANYWAY overrides.
EXPERIMENT_KEYS = (
    "MODEL.ARCH", "MODEL.NUM_CLASSES", "TRAIN.DATASET", "TRAIN.SPLIT", "TRAIN.ANN_FILE", "TRAIN.IM_SIZE",
    "OPTIM.OPTIMIZER",
)  # fmt: skip
# Keys that may change on a resume without changing what is trained: logged, not warned about.
# Nor are they taken from a checkpoint: where and how the run ran is not what it trained (and
# precise BN, BN., runs in test_net.py only when its command line asks).
RUNTIME_KEYS = (
    "OPTIM.MAX_EPOCH", "TRAIN.PRINT_FREQ", "TEST.PRINT_FREQ", "TRAIN.WORKERS", "TRAIN.PREFETCH_FACTOR",
    "TRAIN.PERSISTENT_WORKERS", "TRAIN.PIN_MEMORY", "TRAIN.CKPT_PERIOD_ITERS", "TRAIN.KEEP_CKPTS",
    "TRAIN.STOP_AFTER_EPOCHS", "TRAIN.EVAL_PERIOD", "TRAIN.AUTO_RESUME", "TRAIN.RESUME_ANYWAY", "TEST.BATCH_SIZE",
    "DATA.DECODER", "DATA.INDEX_CACHE", "MODEL.WEIGHTS", "OUT_DIR", "CFG_DEST", "DIST.", "CUDNN.", "BN.", "LOG.PLOT",
    "MODEL.ACTIVATION_CHECKPOINTING", "MODEL.GRAD_CHECKPOINT", "LOG.PEAK_TFLOPS", "LOG.STRAGGLER_FACTOR",
)  # fmt: skip
# The keys that shape the model and its input: what predict.py and export.py take from a checkpoint.
MODEL_KEYS = (
    "MODEL.ARCH", "MODEL.NUM_CLASSES", "MODEL.KWARGS", "TRAIN.IM_SIZE", "TEST.IM_SIZE", "TEST.CROP_SIZE",
    "TEST.CROP_PCT", "TEST.INTERPOLATION", "DATA.MEAN", "DATA.STD", "TRAIN.TOPK", "MODEL.TASK", "TEST.THRESHOLD",
)  # fmt: skip
# The keys whose values change the model's tensors: the ones a weights mismatch names.
SHAPE_KEYS = ("MODEL.ARCH", "MODEL.NUM_CLASSES", "MODEL.KWARGS")


def stored_cfg(state: dict) -> CfgNode:
    """The config the checkpoint's run stored (empty for a checkpoint written without one)."""
    return stored_config(state["cfg"], "the checkpoint") if state.get("cfg") else CfgNode()


def run_keys() -> list[str]:
    """Every config key but the runtime ones: the run's experiment (model, data, preprocessing, training)."""
    return [k for k in flatten(get_cfg_defaults()) if not k.startswith(RUNTIME_KEYS)]


def cfg_from_checkpoint(
    state: dict, cfg_file: str | None, opts: Sequence[str], keys: Sequence[str], source: str = "the checkpoint"
) -> CfgNode:
    """Defaults < the checkpoint's ``keys`` (its classes and arch where it names them) < ``--cfg FILE`` < ``KEY VALUE`` pairs."""
    base = get_cfg_defaults()
    # For checkpoints without a config: their classes, else the count the default was before it was the data's.
    classes = len(state.get("classes") or ()) or LEGACY_CLASSES
    base.MODEL.NUM_CLASSES = classes
    base.TRAIN.TOPK = min(base.TRAIN.TOPK, classes)
    saved, known = flatten(stored_cfg(state)), flatten(base)
    # Keys a later version dropped are skipped: the checkpoint still loads.
    merge_pairs(base, {k: saved[k] for k in keys if k in saved and k in known}, f"{source}'s config")
    if state.get("arch"):
        base.MODEL.ARCH = state["arch"]
    return load_cfg(cfg_file, opts, base=base)


def evaluation_cfg(cfg_file: str | None, opts: Sequence[str]) -> CfgNode:
    """test_net.py's config: defaults < MODEL.WEIGHTS's stored run keys (``run_keys``) < ``--cfg FILE`` < ``KEY VALUE`` pairs.

    Its OUT_DIR, unless the file or the pairs give one, is the checkpoint's own (``evaluation_out_dir``),
    never the training default's: a training run there would read the record as its own.
    """
    asked = load_cfg(cfg_file, opts)  # a bad key or value is named before any checkpoint is read
    if not asked.MODEL.WEIGHTS:
        return asked  # test_model says that it needs weights
    weights = asked.MODEL.WEIGHTS
    with named_by("MODEL.WEIGHTS"):
        state = load_checkpoint(weights)
    cfg = cfg_from_checkpoint(state, cfg_file, opts, run_keys(), source=weights)
    if "OUT_DIR" not in keys_given(cfg_file, opts):
        cfg.defrost()
        cfg.OUT_DIR = evaluation_out_dir(weights)
        cfg.freeze()
    return cfg


def evaluation_out_dir(weights: str) -> str:
    """Where test_net.py writes when no OUT_DIR is given: ``eval_<the checkpoint's name>`` beside the
    checkpoint, or in its run's folder for one in a run's checkpoints/ (output/digits/eval_best)."""
    folder, name = os.path.split(os.path.normpath(weights))
    if os.path.basename(folder) == CKPT_DIR:
        folder = os.path.dirname(folder)
    for suffix in (FILE, SHARDED, ".pth", ".pt"):
        name = name.removesuffix(suffix)
    return os.path.join(folder, f"eval_{name}")


def fit_hint(state: dict, cfg: CfgNode | None) -> str:
    """What to change when the checkpoint's weights do not fit ``cfg``'s model: the keys its run had
    otherwise, and that run's config file ('' when the checkpoint stores no config)."""
    saved = flatten(stored_cfg(state))
    if not saved or cfg is None:
        return ""
    own = flatten(cfg)
    differ = [k for k in SHAPE_KEYS if k in saved and str(saved[k]) != str(own.get(k))]
    run_cfg = os.path.join(str(saved.get("OUT_DIR", "")), str(saved.get("CFG_DEST") or "config.yaml"))
    config = f"--cfg {run_cfg}" if os.path.isfile(run_cfg) else "no --cfg: the checkpoint's own config"
    if not differ:
        return f"evaluate with its run's config ({config})"
    trained = ", ".join(f"{k} {saved[k]} (here {own.get(k)})" for k in differ)
    fix = ", ".join(f"{k} {saved[k]}" for k in differ)
    return f"it was trained with {trained}: set {fix}, or evaluate with its run's config ({config})"
