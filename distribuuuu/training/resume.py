"""Saving a run and putting it back: the run's Checkpointer (its format decided once), the checkpoint
a run resumes and what changed since it, what TRAIN.LOAD_OPT puts back, and MODEL.WEIGHTS loaded.

What a checkpoint holds is defined once, in components.py; how it lies on disk, in
checkpointing/formats.py; saving, pruning, finding and loading, in checkpointing/manager.py.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from yacs.config import CfgNode

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.formats import FORMATS, file_states, load_file_state, to_restore
from distribuuuu.checkpointing.manager import Checkpointer
from distribuuuu.config import ConfigError, config_changes, stored_config
from distribuuuu.logger import SAME_ON_EVERY_RANK, get_logger
from distribuuuu.models import load_model_weights, versioned, weights_fit
from distribuuuu.runtime.parallel import is_sharded
from distribuuuu.training.class_count import with_class_count
from distribuuuu.training.components import run_components
from distribuuuu.training.preprocessing import checkpoint_preprocessing, eval_preprocessing
from distribuuuu.training.state import Run
from distribuuuu.training.stored_config import EXPERIMENT_KEYS, RUNTIME_KEYS, fit_hint

logger = get_logger("state")

# MODEL.WEIGHTS must fill at least this share of the model's values (elements). A new head (the
# documented fine-tuning) leaves out a small share (resnet18, 10 to 3 classes: 0.01%; the suite's
# tiny CNN: 3%), and weights of a smaller sibling fill more than half (resnet18 into resnet34: 54%);
# another architecture fills next to nothing (mobilenet_v3_small into resnet18: 0 of 122 tensors),
# which trained from scratch behind one line of missing keys.
MIN_FILLED_SHARE = 0.5


def checkpointer(cfg: CfgNode) -> Checkpointer:
    """The run's Checkpointer, its format decided here once: DIST.CKPT_FORMAT ("": sharded DCP folders
    under fsdp/hsdp, single files under ddp), TRAIN.KEEP_CKPTS, TRAIN.CKPT_ASYNC."""
    sharded = cfg.DIST.CKPT_FORMAT == "sharded" or (not cfg.DIST.CKPT_FORMAT and cfg.DIST.STRATEGY != "ddp")
    fmt = FORMATS["sharded" if sharded else "file"]()
    return Checkpointer(cfg.OUT_DIR, fmt, cfg.TRAIN.KEEP_CKPTS, cfg.TRAIN.CKPT_ASYNC)


def training_state(run: Run) -> dict:
    """Everything continuing needs, as one flat dict; collective (ZeRO consolidation, RNG gather): all ranks."""
    return file_states(run_components(run))[0]


def save_training_checkpoint(
    run: Run, checkpoints: Checkpointer, is_best: bool = False, background: bool = False
) -> str:
    """Write the run's state where it is (and, ``is_best``, its weights as the best); all ranks call this."""
    epoch_1based = run.state.epoch + (1 if run.state.step_in_epoch else 0)
    return checkpoints.save(run_components(run), epoch_1based, run.state.step_in_epoch, is_best, background)


class ResumePoint(NamedTuple):
    """The checkpoint AUTO_RESUME continues from (None: a new run), what changed since it, its epochs done."""

    path: str | None = None
    changes: list[str] = []
    epochs_done: int = 0


def find_checkpoint_to_resume(cfg: CfgNode, checkpoints: Checkpointer | None = None) -> ResumePoint:
    """The checkpoint AUTO_RESUME continues from, and what changed since it (rank 0, before any write).

    A checkpoint of another experiment (EXPERIMENT_KEYS differ) is a ConfigError naming the keys
    and the way out, so a second experiment never continues the first one's weights.
    """
    if not cfg.TRAIN.AUTO_RESUME:
        return ResumePoint()
    path, small = (checkpoints or checkpointer(cfg)).find_resumable()  # a converted copy beside it: this format's
    if path is None:
        return ResumePoint()
    stored = stored_config(small["cfg"], path) if small.get("cfg") else None
    changes = config_changes(stored, as_trained(cfg, stored)) if stored is not None else []
    # Without LOAD_OPT the optimizer state is not restored: a new optimizer on the old weights is a
    # deliberate continuation, not a second experiment.
    keys = [k for k in EXPERIMENT_KEYS if cfg.TRAIN.LOAD_OPT or k != "OPTIM.OPTIMIZER"]
    clash = [c for c in changes if c.split(":")[0] in keys]
    if clash and not cfg.TRAIN.RESUME_ANYWAY:
        new_optimizer = any(c.startswith("OPTIM.OPTIMIZER:") for c in clash)
        raise ConfigError(
            f"OUT_DIR {cfg.OUT_DIR} holds another experiment ({path}): {'; '.join(clash)}. Give this run "
            "its own OUT_DIR, or set TRAIN.RESUME_ANYWAY True to continue that run with these values"
            + (" (TRAIN.LOAD_OPT False continues from its weights with the new optimizer)" if new_optimizer else "")
        )
    return ResumePoint(path, changes, small["epoch"])


def as_trained(cfg: CfgNode, stored: CfgNode) -> CfgNode:
    """``cfg`` as the checkpoint's run resolved it: a class count left to the data (MODEL.NUM_CLASSES 0)
    is the one that run's data gave, which the checkpoint stored (the ``classes`` component checks the
    data still has as many)."""
    count = stored.get("MODEL", {}).get("NUM_CLASSES")
    return with_class_count(cfg, count) if isinstance(count, int) and count > 0 else cfg


def log_config_changes(path: str | None, changes: list[str]) -> None:
    """Log what changed since the checkpoint: runtime keys as information, the rest as warnings."""
    runtime = [c for c in changes if c.split(":")[0].startswith(RUNTIME_KEYS)]
    others = [c for c in changes if c not in runtime]
    if runtime:
        logger.info("resuming %s with changed runtime keys: %s", path, "; ".join(runtime))
    if others:
        logger.warning("resuming %s with changed training keys (they apply from here on): %s", path, "; ".join(others))


def resume_or_load_weights(run: Run, checkpoints: Checkpointer, path: str | None) -> None:
    """Resume from ``path`` (find_checkpoint_to_resume's choice), else load MODEL.WEIGHTS if given."""
    cfg = run.cfg
    if path:
        if cfg.MODEL.WEIGHTS:
            logger.info("resuming from %s: it wins over MODEL.WEIGHTS %s", path, cfg.MODEL.WEIGHTS)
        if is_sharded(run.model) and not path.endswith(ckpt.SHARDED):
            raise ckpt.CheckpointError(
                f"{path} is a single-file checkpoint and DIST.STRATEGY {cfg.DIST.STRATEGY} shards the model: convert "
                f"it once with tools/convert_checkpoint.py {path} {path.replace(ckpt.FILE, ckpt.SHARDED)}, or resume "
                "with DIST.STRATEGY ddp"
            )
        checkpoints.load(to_restore(run_components(run), cfg.TRAIN.LOAD_OPT), path)
        logger.info("resumed from %s at epoch %d, step %d", path, run.state.epoch + 1, run.state.step_in_epoch)
    elif cfg.MODEL.WEIGHTS:
        load_configured_weights(run.model, cfg, strict=False)
        if run.ema is not None:  # sharded alike under fsdp: shard by shard, nothing gathered
            run.ema.module.load_state_dict(run.model.state_dict())


def restore_training_state(run: Run, state: dict, path: str) -> None:
    """Load a single file's dict into the run (weights and position always; the rest with TRAIN.LOAD_OPT)."""
    load_file_state(to_restore(run_components(run), run.cfg.TRAIN.LOAD_OPT), state, path)


def restore_progress(run: Run, state: dict) -> None:
    """Epoch, steps, best and the global sample position from a checkpoint's dict (logs a global batch change)."""
    components = run_components(run)
    load_file_state({name: components[name] for name in ("progress", "position")}, state, "checkpoint")


def load_configured_weights(model: nn.Module, cfg: CfgNode, strict: bool = True, arch: str = "") -> dict:
    """MODEL.WEIGHTS (of MODEL.WEIGHTS_KIND) loaded into ``model`` by ``load_weights``. A checkpoint that
    is not there, does not load or does not fit is bad input: a ConfigError naming the key (exit 2)."""
    with ckpt.named_by("MODEL.WEIGHTS"):
        return load_weights(model, cfg.MODEL.WEIGHTS, cfg.MODEL.WEIGHTS_KIND, strict, arch or cfg.MODEL.ARCH, cfg)


def load_weights(
    model: nn.Module, path: str, kind: str = "model", strict: bool = True, arch: str = "", cfg: CfgNode | None = None
) -> dict:
    """Load MODEL.WEIGHTS into ``model`` (built for MODEL.ARCH ``arch``, from ``cfg``); with strict=False,
    tensors of another shape are skipped. Strict weights that do not fit, and others that fill less
    than MIN_FILLED_SHARE of the model's values, raise CheckpointError (naming the keys of ``cfg``
    the checkpoint's run had otherwise)."""
    state = ckpt.load_checkpoint(path)
    weights = ckpt.model_state_from(state, kind)
    own = model.state_dict()  # under FSDP2 DTensors: their shape and number of values are the full ones
    skipped: list[str] = []
    if strict:
        check_weights_fit(own, weights, path, state.get("arch"), arch, fit_hint(state, cfg))
    else:
        check_weights_fill(own, weights, path, arch, fit_hint(state, cfg))
        skipped = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
        weights = {k: v for k, v in weights.items() if k not in skipped}
        if skipped:
            logger.info("MODEL.WEIGHTS: skipped %d tensors of another shape (new head?): %s", len(skipped), skipped[:4])
    result = load_full_weights(model, weights, strict)
    missing = [k for k in result.missing_keys if k not in skipped]  # a new head: said once, above
    if not strict and (missing or result.unexpected_keys):
        logger.warning(
            "MODEL.WEIGHTS %s: missing %s, unexpected %s",
            path,
            missing[:4],
            result.unexpected_keys[:4],
            extra=SAME_ON_EVERY_RANK,  # every rank loads the same file into the same model: rank 0 says it
        )
    logger.info("loaded %s weights from %s", kind, path)
    return state


def check_weights_fit(own: dict, weights: dict, path: str, saved_arch: str | None, arch: str, hint: str = "") -> None:
    """One line instead of load_state_dict's page of key names: which model the file holds, or
    how many tensors are missing, unexpected or of another shape, then ``hint`` (``fit_hint``)."""
    if saved_arch and arch and saved_arch.split(":")[0] != arch.split(":")[0]:
        raise ckpt.CheckpointError(
            f"{path} holds {saved_arch} weights but MODEL.ARCH is {arch}: set MODEL.ARCH {saved_arch} to load it"
        )
    _, missing, unexpected, shapes, _ = weights_fit(own, weights)
    if missing or unexpected or shapes:
        example = f"{shapes[0]}: {list(weights[shapes[0]].shape)} in the file" if shapes else ""
        raise ckpt.CheckpointError(
            f"{path} does not fit MODEL.ARCH {arch or '?'}: {len(missing)} tensor(s) missing {missing[:2]}, "
            f"{len(unexpected)} unexpected {unexpected[:2]}, {len(shapes)} of another shape {example}".rstrip()
            + (f"; {hint}" if hint else "")
        )


def check_weights_fill(own: dict, weights: dict, path: str, arch: str, hint: str = "") -> None:
    """Raise a CheckpointError naming how many tensors ``weights`` fill when they fill less than
    MIN_FILLED_SHARE of ``own``'s values: another model's weights, which would leave it as built."""
    fit = weights_fit(own, weights)
    if fit.share < MIN_FILLED_SHARE:
        raise ckpt.CheckpointError(
            f"{path} fills {len(fit.filled)} of the {len(own)} tensors of {f'MODEL.ARCH {arch}' if arch else 'the model'} "
            f"({fit.share:.0%} of its values; weights must fill at least {MIN_FILLED_SHARE:.0%}): another model's "
            f"weights? ({fit.shortfall()})" + (f"; {hint}" if hint else "")
        )


def load_full_weights(model: nn.Module, weights: dict, strict: bool = True):
    """Load full (unsharded) weights into ``model``; a sharded model takes its own slice of each tensor."""
    if not is_sharded(model):
        return load_model_weights(model, weights, strict)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    return set_state_dict(model, [], model_state_dict=versioned(weights, model), optim_state_dict={}, options=options)


def warn_if_evaluated_otherwise(state: dict, cfg: CfgNode, path: str) -> None:
    """Warn when this config's evaluation preprocessing is not the one the checkpoint's run
    validated with: its accuracy would not be the run's (nor predict.py's, nor an export's)."""
    if not (state.get("preprocessing") or state.get("cfg")):
        return  # weights from elsewhere: nothing to compare with
    own, saved = eval_preprocessing(cfg), checkpoint_preprocessing(state)
    if own != saved:
        logger.warning(
            "%s was validated with %s; this evaluation uses %s (set TEST.IM_SIZE / CROP_SIZE / CROP_PCT / "
            "INTERPOLATION and DATA.MEAN / STD as its run did, e.g. --cfg OUT_DIR/config.yaml, to evaluate as it did)",
            path, saved.as_dict(), own.as_dict(),
        )  # fmt: skip
