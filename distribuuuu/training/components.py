"""A run's state defined once: the components a checkpoint holds, and what DCP saves of each.

Each component is a ``checkpointing.formats.Component`` (a ``Stateful``: ``state_dict()`` /
``load_state_dict()``), as torchtitan's checkpointer keeps its ``states``: ``run_components``
lists them, and the Checkpointer writes and reads both formats from that one list. A single file is the
components' ``state_dict()`` entries merged into one flat dict (the keys the package has always
written: "model", "epoch", "cfg", ...: the tools read them, and old files load unchanged). A DCP
folder holds the tensors each rank has a shard of (a component's ``shards()``: model, optimizer,
EMA) in DCP's shards, and every other entry in ``extra.pt``. Adding a piece of state is one
component in ``run_components`` (or, from outside the package, one entry of ``Run.registered_state``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from distribuuuu.checkpointing.formats import Component
from distribuuuu.checkpointing.single_file import model_state_from
from distribuuuu.config import ConfigError, stored_config
from distribuuuu.errors import CheckpointError, first_line
from distribuuuu.logger import get_logger
from distribuuuu.models import load_model_weights, versioned
from distribuuuu.runtime.process_group import all_gather_object, broadcast_buffers, is_main_process
from distribuuuu.training.ema import ModelEMA
from distribuuuu.training.preprocessing import eval_preprocessing
from distribuuuu.training.rng import capture_rng_state, restore_rng_state
from distribuuuu.training.state import global_batch

if TYPE_CHECKING:
    from distribuuuu.training.state import Run

logger = get_logger("state")


class Registered(Component):
    """Any other Stateful (a counter, a data loader's state) under its own key: ``state[name]``."""

    def __init__(self, name: str, stateful: Stateful):
        self.name, self.stateful = name, stateful

    def state_dict(self) -> dict:
        return {self.name: self.stateful.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.name in state_dict:  # a checkpoint written before it was registered has none
            self.stateful.load_state_dict(state_dict[self.name])


class Model(Component):
    """The model's weights: ``model``."""

    sharded = in_weights = True

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        load_model_weights(self.model, model_state_from(state_dict))

    def shards(self) -> Stateful:
        return ModelShards(self.model)


_LOAD_OPT_HINT = "set TRAIN.LOAD_OPT False to resume from its weights only"


class Optimizer(Component):
    """The optimizer's state: ``optimizer``, numbered by position in a file, keyed by name in shards."""

    sharded = resumes_training = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, name: str):
        self.model, self.optimizer, self.name = model, optimizer, name

    def state_dict(self) -> dict:
        if hasattr(self.optimizer, "consolidate_state_dict"):  # ZeRO-1: gather the shards on rank 0 (collective)
            self.optimizer.consolidate_state_dict(to=0)
            return {"optimizer": self.optimizer.state_dict() if is_main_process() else None}
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """PyTorch checks only the parameter-group sizes: SGD's state loads into AdamW without
        complaint and fails at the first step with a KeyError, so the optimizer's name is compared first."""
        self.check_name(state_dict)
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(
                f"its optimizer state does not fit this run ({first_line(e)}): {_LOAD_OPT_HINT}"
            ) from None

    def check_name(self, state_dict: dict) -> None:
        """Raise CheckpointError if the checkpoint's optimizer (its config's) is another one than this run's."""
        cfg = state_dict.get("cfg")
        saved = stored_config(cfg, "the checkpoint").get("OPTIM", {}).get("OPTIMIZER") if cfg else None
        if saved and saved != self.name:
            raise CheckpointError(
                f"it holds {saved} optimizer state but OPTIM.OPTIMIZER is {self.name}: {_LOAD_OPT_HINT}"
            )

    def shards(self) -> Stateful:
        return OptimizerShards(self.model, self.optimizer)

    def load_extra_state_dict(self, extra: dict) -> None:
        self.check_name(extra)  # before DCP reads another optimizer's state into this one


class EMA(Component):
    """The averaged weights and their update count: ``ema`` (None without OPTIM.EMA_DECAY)."""

    sharded = in_weights = resumes_training = True

    def __init__(self, ema: ModelEMA | None):
        self.ema = ema

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict() if self.ema is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("ema") and self.ema is not None:
            self.ema.load_state_dict(state_dict["ema"])

    def shards(self) -> Stateful | None:
        return EMAShards(self.ema) if self.ema is not None else None

    def extra_state_dict(self) -> dict:
        return {"ema_updates": self.ema.updates if self.ema is not None else 0}

    def load_extra_state_dict(self, extra: dict) -> None:
        if self.ema is not None:
            self.ema.updates = int(extra.get("ema_updates", 0))


class Scaler(Component):
    """fp16's loss scale: ``scaler`` (None when disabled)."""

    resumes_training = True

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state_dict["scaler"])


class RNG(Component):
    """Every rank's RNG states: ``rng`` (gathered: collective), restored on the saving run's world size."""

    resumes_training = True

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict:
        return {"rng": all_gather_object(capture_rng_state())}

    def load_state_dict(self, state_dict: dict) -> None:
        # On another world size the ranks' streams do not map one to one: each rank keeps its fresh seed.
        if self.rank < len(state_dict["rng"]) and state_dict["world_size"] == self.world_size:
            restore_rng_state(state_dict["rng"][self.rank])


class Progress(Component):
    """Epochs done and the best so far: ``epoch``, and the best's ``best_acc1``, ``best_weights``,
    ``best_metric`` (TRAIN.BEST_METRIC) and ``best_value`` (``state.Best``)."""

    in_weights = True

    def __init__(self, run: Run):
        self.run = run

    def state_dict(self) -> dict:
        return {"epoch": self.run.state.epoch, **self.run.best.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.run.state.epoch = state_dict["epoch"]
        self.run.best.load_state_dict(state_dict)


class Position(Component):
    """Where in the epoch, and on which global batch: ``step_in_epoch``, ``samples_in_epoch`` (the global
    sample position: resumable on any world size), ``global_batch``, ``steps_per_epoch``, ``world_size``."""

    def __init__(self, run: Run):
        self.run = run

    def state_dict(self) -> dict:
        run = self.run
        return {
            "step_in_epoch": run.state.step_in_epoch,
            "samples_in_epoch": run.state.samples_in_epoch,
            "global_batch": run.global_batch,
            "steps_per_epoch": run.steps_per_epoch,
            "world_size": run.env.world_size,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """On another global batch, say what that changes (after Progress: the log names the epoch)."""
        run, saved_batch = self.run, state_dict.get("global_batch") or saved_global_batch(state_dict)
        run.state.step_in_epoch = state_dict["step_in_epoch"]
        run.state.samples_in_epoch = state_dict.get("samples_in_epoch", state_dict["step_in_epoch"] * saved_batch)
        if saved_batch != run.global_batch:
            log_global_batch_change(run, saved_batch, state_dict)


class EpochProgress(Component):
    """The epoch in progress's training sums, seconds and resumed steps (``state.EpochTotals``):
    ``epoch_totals``. Read back only where the checkpoint is mid-epoch (after Position)."""

    def __init__(self, run: Run):
        self.run = run

    def state_dict(self) -> dict:
        return {"epoch_totals": self.run.epoch_totals.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        step = self.run.state.step_in_epoch
        if step:
            self.run.epoch_totals.resume(state_dict.get("epoch_totals"), step)


def saved_global_batch(state: dict) -> int:
    """The global batch of a checkpoint written before it recorded one: from its config and world size."""
    return global_batch(stored_config(state["cfg"], "the checkpoint").TRAIN, state["world_size"])


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


class Described(Component):
    """What the run was (classes, architecture, config, evaluation preprocessing): written for the
    tools (test_net, predict, export, fine-tuning) and for the resume's config comparison; a resume
    keeps its own, so nothing is loaded back."""

    in_weights = True  # what predict.py, export.py and test_net.py read of the best weights

    def __init__(self, **entries):
        self.entries = entries

    def state_dict(self) -> dict:
        return dict(self.entries)

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class Classes(Component):
    """The class names the run trains, in label order: ``classes`` (the tools name predictions by
    them). A checkpoint of another number of classes does not resume: a count left to the data
    (MODEL.NUM_CLASSES 0) follows the folders, where the config comparison cannot see a change."""

    in_weights = True

    def __init__(self, classes: list[str]):
        self.classes = list(classes)

    def state_dict(self) -> dict:
        return {"classes": self.classes}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("classes")
        if saved and len(saved) != len(self.classes):
            raise ConfigError(
                f"TRAIN.DATASET: the checkpoint to resume was trained on {len(saved)} classes, the training data "
                f"now has {len(self.classes)}: give this run its own OUT_DIR"
            )


class TeacherIdentity(Component):
    """Which teacher the run distils from: ``teacher`` (DISTILL.TEACHER's path, its weights' SHA-256,
    architecture, weights kind); nothing without one. Its logits are never saved. Resuming with
    another teacher (other weights, or none where there was one) is refused: a run has one teacher."""

    in_weights = True  # what the weights were distilled from, beside the config

    def __init__(self, identity: dict | None):
        self.identity = identity

    def state_dict(self) -> dict:
        return {"teacher": self.identity} if self.identity is not None else {}  # without one: as before distillation

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("teacher")
        if _sha256(saved) != _sha256(self.identity):
            raise ConfigError(
                f"DISTILL.TEACHER: the checkpoint to resume was distilled from {_teacher_text(saved)}, this run from "
                f"{_teacher_text(self.identity)}: give this run its own OUT_DIR, or set DISTILL.TEACHER to its teacher"
            )


def _sha256(identity: dict | None) -> str | None:
    return identity["sha256"] if identity else None


def _teacher_text(identity: dict | None) -> str:
    return f"{identity['path']} (weights sha256 {identity['sha256'][:12]})" if identity else "no teacher"


def run_components(run: Run) -> dict[str, Component]:
    """The run's state, defined once: every component a checkpoint holds, in the order they load."""
    components = {
        "classes": Classes(run.train.classes),  # first: another class count is named before the weights fail to fit
        "model": Model(run.model),
        "progress": Progress(run),
        "position": Position(run),  # after progress: its log names the epoch
        "epoch_totals": EpochProgress(run),  # after position: only a mid-epoch checkpoint's are taken up
        "optimizer": Optimizer(run.model, run.optimizer, run.cfg.OPTIM.OPTIMIZER),
        "ema": EMA(run.ema),
        "scaler": Scaler(run.scaler),
        "rng": RNG(run.env.rank, run.env.world_size),
        "config": Described(arch=run.cfg.MODEL.ARCH, cfg=run.cfg.dump()),
        # What validation did to the images: predict.py and export.py preprocess as it did
        "preprocessing": Described(preprocessing=eval_preprocessing(run.cfg).as_dict()),
        "teacher": TeacherIdentity(run.teacher.identity if run.teacher is not None else None),
    }
    for name, stateful in run.registered_state.items():
        components[name] = stateful if isinstance(stateful, Component) else Registered(name, stateful)
    return components


# ------------------------------------------------------------------------------------------------
# What DCP saves of a model, an optimizer, an EMA: Stateful views, as torchtitan's ModelWrapper.
# DCP calls state_dict() on each (on save, and on load for the tensors to load into), then
# load_state_dict() with what it read. Keys are parameter names: a checkpoint loads on any sharding.
# ------------------------------------------------------------------------------------------------
class ModelShards(Stateful):
    """A model's weights as DCP saves them: each rank its shards (FSDP2 DTensors), or whole tensors."""

    def __init__(self, model: nn.Module):
        # Buffers (BatchNorm statistics) are not sharded and differ per rank; DCP would keep any one
        # rank's copy. Rank 0's, as in a single-file checkpoint; training-mode forwards never read them.
        broadcast_buffers(model)
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, versioned(state_dict, self.model))


class OptimizerShards(Stateful):
    """An optimizer's state keyed by parameter name (not by position), each rank its shards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class EMAShards(Stateful):
    """The EMA's averaged weights, sharded as the model's (its update count is small state: ``ema_updates``)."""

    def __init__(self, ema: ModelEMA):
        broadcast_buffers(ema.module)
        self.ema = ema

    def state_dict(self) -> dict:
        return self.ema.module.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        load_model_weights(self.ema.module, state_dict)
