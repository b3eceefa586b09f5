"""What a checkpoint holds of a run, and putting it back: training_state, save, resume, load_weights."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from yacs.config import CfgNode

from distribuuuu import checkpoint as ckpt
from distribuuuu import sharded_checkpoint as shards
from distribuuuu.config import ConfigError, config_changes
from distribuuuu.data.transforms import checkpoint_preprocessing, eval_preprocessing
from distribuuuu.distributed import all_gather_object, rank0_decides
from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger
from distribuuuu.parallel import is_sharded
from distribuuuu.rng import capture_rng_state, restore_rng_state
from distribuuuu.run import Run, TrainState

logger = get_logger("state")


def training_state(run: Run) -> dict:
    """Everything continuing needs; collective (ZeRO consolidation, RNG gather): call on all ranks."""
    optimizer = run.optimizer
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather the shards on rank 0
        optimizer.consolidate_state_dict(to=0)
        opt_state = optimizer.state_dict() if run.env.is_main_process else None
    else:
        opt_state = optimizer.state_dict()
    return {
        "model": run.model.state_dict(),
        "optimizer": opt_state,
        "ema": run.ema.state_dict() if run.ema is not None else None,
        **progress_state(run),
    }


def progress_state(run: Run) -> dict:
    """A checkpoint's non-tensor state (a sharded one's extra.pt); collective (the RNG gather)."""
    return {
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "epoch": run.state.epoch,
        "step_in_epoch": run.state.step_in_epoch,
        "samples_in_epoch": run.state.samples_in_epoch,  # the global position: resumable on any world size
        "global_batch": run.global_batch,
        "steps_per_epoch": run.steps_per_epoch,
        "best_acc1": run.state.best_acc1,
        "best_weights": run.state.best_weights,
        "rng": all_gather_object(capture_rng_state()),
        "world_size": run.env.world_size,
        "classes": run.train.classes,
        "arch": run.cfg.MODEL.ARCH,
        "cfg": run.cfg.dump(),
        # What validation did to the images: predict.py and export.py preprocess as it did
        "preprocessing": eval_preprocessing(run.cfg).as_dict(),
    }


def save_training_checkpoint(run: Run, is_best: bool = False) -> str:
    """Write the current state to OUT_DIR/checkpoints (and the best weights); all ranks call this."""
    epoch_1based = run.state.epoch + (1 if run.state.step_in_epoch else 0)
    ckpt_dir = os.path.join(run.cfg.OUT_DIR, ckpt.CKPT_DIR)
    if run.sharded_checkpoints:
        path = save_sharded_training_checkpoint(run, ckpt_dir, epoch_1based, is_best)
        logger.info("saved %s%s", path, " (best)" if is_best else "")
        return path
    state = training_state(run)
    path = os.path.join(ckpt_dir, ckpt.checkpoint_name(epoch_1based, run.state.step_in_epoch))

    def write() -> None:
        ckpt.save_checkpoint(state, path)
        if is_best:
            ckpt.save_checkpoint(weights_only_state(state), os.path.join(run.cfg.OUT_DIR, ckpt.BEST_NAME))
        try:
            ckpt.prune_checkpoints(ckpt_dir, run.cfg.TRAIN.KEEP_CKPTS)
        except OSError as e:
            raise ckpt.CheckpointError(f"could not remove an old checkpoint in {ckpt_dir}: {e}") from None

    rank0_decides(write)  # every rank stops on a failed write, not only rank 0
    logger.info("saved %s%s", path, " (best)" if is_best else "")
    return path


def save_sharded_training_checkpoint(run: Run, ckpt_dir: str, epoch_1based: int, is_best: bool) -> str:
    """Each rank writes its own shard (DCP), never the whole model on one rank; best weights as best.dcp."""
    extra = progress_state(run)
    path = os.path.join(ckpt_dir, shards.sharded_name(epoch_1based, run.state.step_in_epoch))
    shards.save_sharded(path, run.model, run.optimizer, extra, run.ema)
    if is_best:
        best = {k: v for k, v in extra.items() if k in WEIGHTS_ONLY_KEYS}
        shards.save_sharded(os.path.join(run.cfg.OUT_DIR, BEST_SHARDED), run.model, None, best, run.ema)

    def prune() -> None:
        try:
            shards.prune_sharded(ckpt_dir, run.cfg.TRAIN.KEEP_CKPTS)
        except OSError as e:
            raise ckpt.CheckpointError(f"could not remove an old checkpoint in {ckpt_dir}: {e}") from None

    rank0_decides(prune)
    return path


WEIGHTS_ONLY_KEYS = ("model", "ema", "epoch", "best_acc1", "best_weights", "classes", "arch", "cfg", "preprocessing")
BEST_SHARDED = "best.dcp"  # under sharded checkpoints: the best weights (and EMA), no optimizer


def weights_only_state(state: dict) -> dict:
    """What evaluation and fine-tuning need of a training state (best.pth.tar): no optimizer, RNG or scaler."""
    return {k: state[k] for k in WEIGHTS_ONLY_KEYS}


# Keys that make another experiment: resuming a checkpoint trained with other values would mix
# two runs in one OUT_DIR (and one record). TRAIN.RESUME_ANYWAY overrides.
EXPERIMENT_KEYS = (
    "MODEL.ARCH", "MODEL.NUM_CLASSES", "TRAIN.DATASET", "TRAIN.SPLIT", "TRAIN.IM_SIZE", "OPTIM.OPTIMIZER",
)  # fmt: skip
# Keys that may change on a resume without changing what is trained: logged, not warned about.
RUNTIME_KEYS = (
    "OPTIM.MAX_EPOCH", "TRAIN.PRINT_FREQ", "TEST.PRINT_FREQ", "TRAIN.WORKERS", "TRAIN.PREFETCH_FACTOR",
    "TRAIN.PERSISTENT_WORKERS", "TRAIN.PIN_MEMORY", "TRAIN.CKPT_PERIOD_ITERS", "TRAIN.KEEP_CKPTS",
    "TRAIN.STOP_AFTER_EPOCHS", "TRAIN.EVAL_PERIOD", "TRAIN.AUTO_RESUME", "TRAIN.RESUME_ANYWAY", "TEST.BATCH_SIZE",
    "DATA.DECODER", "MODEL.WEIGHTS", "OUT_DIR", "CFG_DEST", "DIST.", "CUDNN.",
)  # fmt: skip


class ResumePoint(NamedTuple):
    """The checkpoint AUTO_RESUME continues from (None: a new run), what changed since it, its epochs done."""

    path: str | None = None
    changes: list[str] = []
    epochs_done: int = 0


def find_checkpoint_to_resume(cfg: CfgNode) -> ResumePoint:
    """The checkpoint AUTO_RESUME continues from, and what changed since it (rank 0, before any write).

    A checkpoint of another experiment (EXPERIMENT_KEYS differ) is a ConfigError naming the keys
    and the way out, so a second experiment never continues the first one's weights.
    """
    if not cfg.TRAIN.AUTO_RESUME:
        return ResumePoint()
    loaded: dict[str, dict] = {}  # the verifying load's state: its config is compared, not read again

    def verify(candidate: str) -> None:
        if candidate.endswith(".dcp"):
            shards.verify_sharded(candidate)
            loaded[candidate] = shards.read_extra(candidate)
        else:
            loaded[candidate] = ckpt.load_checkpoint(candidate)

    path = ckpt.find_resumable(os.path.join(cfg.OUT_DIR, ckpt.CKPT_DIR), listing=shards.list_any, verify=verify)
    if path is None:
        return ResumePoint()
    saved = loaded[path].get("cfg")
    changes = config_changes(CfgNode.load_cfg(saved), cfg) if saved else []
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
    return ResumePoint(path, changes, loaded[path]["epoch"])


def log_config_changes(path: str | None, changes: list[str]) -> None:
    """Log what changed since the checkpoint: runtime keys as information, the rest as warnings."""
    runtime = [c for c in changes if c.split(":")[0].startswith(RUNTIME_KEYS)]
    others = [c for c in changes if c not in runtime]
    if runtime:
        logger.info("resuming %s with changed runtime keys: %s", path, "; ".join(runtime))
    if others:
        logger.warning("resuming %s with changed training keys (they apply from here on): %s", path, "; ".join(others))


def resume_or_load_weights(run: Run, path: str | None) -> None:
    """Resume from ``path`` (find_checkpoint_to_resume's choice), else load MODEL.WEIGHTS if given."""
    cfg = run.cfg
    if path:
        if cfg.MODEL.WEIGHTS:
            logger.info("resuming from %s: it wins over MODEL.WEIGHTS %s", path, cfg.MODEL.WEIGHTS)
        if path.endswith(".dcp"):
            restore_sharded_training_state(run, path)
        else:
            # Always read to the CPU: load_state_dict copies weights to their device, and the RNG
            # states must stay CPU byte tensors (torch.set_rng_state, torch.cuda.set_rng_state).
            restore_training_state(run, ckpt.load_checkpoint(path, map_location="cpu"), path)
        logger.info("resumed from %s at epoch %d, step %d", path, run.state.epoch + 1, run.state.step_in_epoch)
    elif cfg.MODEL.WEIGHTS:
        load_weights(run.model, cfg.MODEL.WEIGHTS, cfg.MODEL.WEIGHTS_KIND, strict=False)
        if run.ema is not None:  # sharded alike under fsdp: shard by shard, nothing gathered
            run.ema.module.load_state_dict(run.model.state_dict())


def restore_training_state(run: Run, state: dict, path: str) -> None:
    """Load a single-file training checkpoint into the run (weights always; the rest with LOAD_OPT)."""
    if is_sharded(run.model):
        raise ckpt.CheckpointError(
            f"{path} is a single-file checkpoint and DIST.STRATEGY {run.cfg.DIST.STRATEGY} shards the model: convert it "
            f"once with tools/convert_checkpoint.py {path} {path.replace('.pth.tar', '.dcp')}, or resume with "
            "DIST.STRATEGY ddp"
        )
    run.model.load_state_dict(ckpt.model_state_from(state))
    restore_progress(run, state)
    if not run.cfg.TRAIN.LOAD_OPT:
        return
    load_optimizer_state(run.optimizer, state, run.cfg.OPTIM.OPTIMIZER, path)
    if state["ema"] and run.ema is not None:
        run.ema.load_state_dict(state["ema"])
    restore_scaler_and_rng(run, state)


def restore_sharded_training_state(run: Run, path: str) -> None:
    """Load a sharded checkpoint: each rank reads the pieces of the saved shards its own shards overlap."""
    load_opt = run.cfg.TRAIN.LOAD_OPT
    if load_opt:
        check_optimizer_name(shards.read_extra(path), run.cfg.OPTIM.OPTIMIZER, path)
    optimizer, ema = (run.optimizer, run.ema) if load_opt else (None, None)
    extra = shards.load_sharded(path, run.model, optimizer, ema)
    restore_progress(run, extra)
    if load_opt:
        restore_scaler_and_rng(run, extra)


def restore_scaler_and_rng(run: Run, state: dict) -> None:
    """The fp16 loss scale, and each rank's RNG states when the world size is the saving run's."""
    if state["scaler"] and run.scaler.is_enabled():
        run.scaler.load_state_dict(state["scaler"])
    if run.env.rank < len(state["rng"]) and state["world_size"] == run.env.world_size:
        restore_rng_state(state["rng"][run.env.rank])


def restore_progress(run: Run, state: dict) -> None:
    """Epoch, steps and the global sample position; on another global batch, say what that changes."""
    saved_batch = state.get("global_batch") or saved_global_batch(state)
    samples = state.get("samples_in_epoch", state["step_in_epoch"] * saved_batch)
    run.state = TrainState(state["epoch"], state["step_in_epoch"], state["best_acc1"], state["best_weights"], samples)
    if saved_batch != run.global_batch:
        log_global_batch_change(run, saved_batch, state)


def saved_global_batch(state: dict) -> int:
    """The global batch of a checkpoint written before it recorded one: from its config and world size."""
    t = CfgNode.load_cfg(state["cfg"]).TRAIN
    return t.BATCH_SIZE * t.ACCUM_STEPS * state["world_size"]


def log_global_batch_change(run: Run, saved_batch: int, state: dict) -> None:
    """Tell what resuming with another global batch does to the epoch and the LR schedule."""
    t, o = run.cfg.TRAIN, run.cfg.OPTIM
    scaled = f"scaled to {run.base_lr:.5g} (OPTIM.REFERENCE_BATCH)" if o.REFERENCE_BATCH else "unchanged"
    logger.warning(
        "global batch changed from %d (%d rank(s)) to %d (%d x %d rank(s) x %d accumulation): the epoch continues "
        "at sample %d of its permutation, each sample of it once; %d steps/epoch instead of %d, and the LR schedule "
        "continues at epoch %.4f (its position counts samples, not steps); base LR %s; RNG states are %s",
        saved_batch, state["world_size"], run.global_batch, t.BATCH_SIZE, run.env.world_size, t.ACCUM_STEPS,
        run.state.samples_in_epoch, run.steps_per_epoch, state["steps_per_epoch"],
        run.schedule_step / run.steps_per_epoch, scaled,
        "restored" if state["world_size"] == run.env.world_size else "re-seeded (another world size)",
    )  # fmt: skip


_LOAD_OPT_HINT = "set TRAIN.LOAD_OPT False to resume from its weights only"


def check_optimizer_name(state: dict, optimizer_name: str, path: str) -> None:
    """Raise CheckpointError if the checkpoint's optimizer is another one than OPTIM.OPTIMIZER."""
    saved = CfgNode.load_cfg(state["cfg"]).get("OPTIM", {}).get("OPTIMIZER") if state.get("cfg") else None
    if saved and saved != optimizer_name:
        raise ckpt.CheckpointError(
            f"{path} holds {saved} optimizer state but OPTIM.OPTIMIZER is {optimizer_name}: {_LOAD_OPT_HINT}"
        )


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, optimizer_name: str, path: str) -> None:
    """Load a checkpoint's optimizer state, or raise CheckpointError naming the file and the way out.

    PyTorch checks only the parameter-group sizes: SGD's state loads into AdamW without complaint
    and fails at the first step with a KeyError, so the optimizer's name is compared first.
    """
    check_optimizer_name(state, optimizer_name, path)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise ckpt.CheckpointError(
            f"{path}: its optimizer state does not fit this run ({first_line(e)}): {_LOAD_OPT_HINT}"
        ) from None


def load_weights(model: nn.Module, path: str, kind: str = "model", strict: bool = True, arch: str = "") -> dict:
    """Load MODEL.WEIGHTS into ``model`` (built for MODEL.ARCH ``arch``); with strict=False,
    tensors of another shape are skipped. Strict weights that do not fit raise CheckpointError."""
    state = ckpt.load_checkpoint(path)
    weights = ckpt.model_state_from(state, kind)
    own = model.state_dict()  # under FSDP2 DTensors: their shape is the full one
    if strict:
        check_weights_fit(own, weights, path, state.get("arch"), arch)
    else:
        skipped = [k for k, v in weights.items() if k in own and own[k].shape != v.shape]
        weights = {k: v for k, v in weights.items() if k not in skipped}
        if skipped:
            logger.info("MODEL.WEIGHTS: skipped %d tensors of another shape (new head?): %s", len(skipped), skipped[:4])
    result = load_full_weights(model, weights, strict)
    if not strict and (result.missing_keys or result.unexpected_keys):
        logger.warning(
            "MODEL.WEIGHTS %s: missing %s, unexpected %s", path, result.missing_keys[:4], result.unexpected_keys[:4]
        )
    logger.info("loaded %s weights from %s", kind, path)
    return state


def check_weights_fit(own: dict, weights: dict, path: str, saved_arch: str | None, arch: str) -> None:
    """One line instead of load_state_dict's page of key names: which model the file holds, or
    how many tensors are missing, unexpected or of another shape."""
    if saved_arch and arch and saved_arch.split(":")[0] != arch.split(":")[0]:
        raise ckpt.CheckpointError(
            f"{path} holds {saved_arch} weights but MODEL.ARCH is {arch}: set MODEL.ARCH {saved_arch} to load it"
        )
    missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    shapes = [k for k in own.keys() & weights.keys() if own[k].shape != weights[k].shape]
    if missing or unexpected or shapes:
        example = f"{shapes[0]}: {list(weights[shapes[0]].shape)} in the file" if shapes else ""
        raise ckpt.CheckpointError(
            f"{path} does not fit MODEL.ARCH {arch or '?'}: {len(missing)} tensor(s) missing {missing[:2]}, "
            f"{len(unexpected)} unexpected {unexpected[:2]}, {len(shapes)} of another shape {example}".rstrip()
        )


def load_full_weights(model: nn.Module, weights: dict, strict: bool = True):
    """Load full (unsharded) weights into ``model``; a sharded model takes its own slice of each tensor."""
    if not is_sharded(model):
        return model.load_state_dict(weights, strict=strict)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    return set_state_dict(model, [], model_state_dict=weights, optim_state_dict={}, options=options)


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
