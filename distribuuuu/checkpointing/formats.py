"""What a checkpoint is made of (``Component``: Stateful pieces of state) and the two formats that
lay them out on disk: ``SingleFile`` (one checksummed file, written by rank 0) and ``Sharded`` (a DCP
folder, every rank its shards). A third format is one more ``Format`` and its entry in ``FORMATS``.

Knows nothing of a run: the components are handed in (``training/components.py`` lists a run's).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable

from torch.distributed.checkpoint.stateful import Stateful

from distribuuuu.checkpointing import sharded as shards
from distribuuuu.checkpointing.background_write import BackgroundWriter, host_copy
from distribuuuu.checkpointing.names import BEST_NAME, BEST_SHARDED, FILE, SHARDED
from distribuuuu.checkpointing.single_file import load_file, save_checkpoint
from distribuuuu.errors import CheckpointError
from distribuuuu.runtime.process_group import is_main_process, rank0_decides


class Component(Stateful):
    """One piece of state a checkpoint holds. ``state_dict()`` returns its entries of a checkpoint's
    flat dict; ``load_state_dict()`` takes the whole dict and reads its entries (older checkpoints
    may lack some)."""

    sharded = False  # its tensors are sharded over the ranks: a sharded checkpoint holds them in DCP's shards
    in_weights = False  # also in the best weights (best.pth.tar / best.dcp), which evaluation and fine-tuning read
    resumes_training = False  # put back only under TRAIN.LOAD_OPT; the weights and the position always are

    def shards(self) -> Stateful | None:
        """A sharded component: what DCP saves of it, each rank its shard (None: nothing to save)."""
        return None

    def extra_state_dict(self) -> dict:
        """A sharded component's small state, kept in extra.pt beside its shards."""
        return {}

    def load_extra_state_dict(self, extra: dict) -> None:
        """Read what ``extra_state_dict`` kept (called before the shards are loaded)."""


Components = dict[str, Component]


def to_restore(components: Components, load_opt: bool) -> Components:
    """The components a resume puts back: all of them under TRAIN.LOAD_OPT, else all but the training ones."""
    return {name: c for name, c in components.items() if load_opt or not c.resumes_training}


def in_weights(components: Components) -> Components:
    """The components the best weights hold (no optimizer, scaler, RNG or position)."""
    return {name: c for name, c in components.items() if c.in_weights}


class Format(abc.ABC):
    """How a checkpoint's components lie on disk: saved (now, or finished by a background writer),
    loaded, and read for the small state a resume looks at first (epoch, config)."""

    name: str  # DIST.CKPT_FORMAT's value
    suffix: str  # a checkpoint's ending in the checkpoints folder
    best_name: str  # the best weights' name in OUT_DIR

    @abc.abstractmethod
    def save(self, components: Components, path: str, best_path: str | None, writer: BackgroundWriter | None):
        """Write ``components`` to ``path`` (and their weights to ``best_path``); every rank calls this.

        With ``writer`` the state is copied now and written in its thread; returns what finishes
        the write there, or None when it is done."""

    @abc.abstractmethod
    def load(self, components: Components, path: str) -> None:
        """Put ``path``'s state into ``components``; every rank calls this."""

    @abc.abstractmethod
    def small_state(self, path: str) -> dict:
        """``path`` verified, and its small state (epoch, cfg, ...); a CheckpointError if it does not verify."""

    @abc.abstractmethod
    def check_written(self, path: str) -> None:
        """Rank 0, once ``path`` is written: a CheckpointError unless it reads back whole."""


class SingleFile(Format):
    """One file: the components' entries merged into one flat dict (the keys the tools read: "model",
    "epoch", "cfg", "classes", ...), checksummed, written atomically by rank 0."""

    name, suffix, best_name = "file", FILE, BEST_NAME

    def save(self, components, path, best_path, writer):
        state, best = file_states(components)  # on all ranks: the RNG gather, ZeRO's consolidation
        if writer is None:
            rank0_decides(lambda: write_files(state, path, best, best_path))  # every rank stops on a failed write
            return None
        if not is_main_process():
            return None
        state, best = host_copy((state, best))  # the next step changes the tensors: copied before it
        return lambda: write_files(state, path, best, best_path)

    def load(self, components, path):
        # Read to the CPU: load_state_dict copies weights to their device, and the RNG states must
        # stay CPU byte tensors (torch.set_rng_state, torch.cuda.set_rng_state).
        load_file_state(components, load_file(path, map_location="cpu"), path)

    def small_state(self, path):
        return load_file(path)

    def check_written(self, path):
        load_file(path)  # the checksum was of the state in memory: this is of the bytes on disk


class Sharded(Format):
    """A DCP folder: the sharded components' tensors in DCP's per-rank shards, every other entry in
    extra.pt, a manifest last; nothing is ever gathered on one rank. Its best weights (best.dcp) are
    written at once: a second background DCP write would share the writer's process group."""

    name, suffix, best_name = "sharded", SHARDED, BEST_SHARDED

    def __init__(self):
        self._group = None  # the gloo group of background writes, made on the first (collective)

    def save(self, components, path, best_path, writer):
        if best_path is not None:
            shards.save_states(best_path, *sharded_parts(in_weights(components)))
        if writer is None:
            shards.save_states(path, *sharded_parts(components))
            return None
        return shards.start_saving_states(path, *sharded_parts(components), self._background_group())

    def _background_group(self):
        """A gloo group of every rank for background DCP writes, whose collectives run in the writer's
        threads beside training's own (None: one process)."""
        import torch.distributed as dist

        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def load(self, components, path):
        load_sharded_state(components, path)

    def small_state(self, path):
        shards.verify_sharded(path)
        return shards.read_extra(path)

    def check_written(self, path):
        return None  # each rank hashed its shard files, as written, for the manifest: read back already


FORMATS: dict[str, type[Format]] = {f.name: f for f in (SingleFile, Sharded)}


def format_of(path: str) -> Format:
    """The format a checkpoint at ``path`` is in (by its name: ``.dcp`` folders are sharded)."""
    return Sharded() if os.path.normpath(path).endswith(SHARDED) else SingleFile()


# ------------------------------------------------------------------------------------------------
# The components in each layout
# ------------------------------------------------------------------------------------------------
def file_states(components: Components) -> tuple[dict, dict]:
    """A single file's flat dict of every component, and of the best weights' (collective: RNG, ZeRO)."""
    parts = {name: c.state_dict() for name, c in components.items()}
    full = {k: v for part in parts.values() for k, v in part.items()}
    best = {k: v for name, part in parts.items() if components[name].in_weights for k, v in part.items()}
    return full, best


def write_files(state: dict, path: str, best: dict, best_path: str | None) -> None:
    """Rank 0: write the checkpoint file (and the best weights)."""
    save_checkpoint(state, path)
    if best_path is not None:
        save_checkpoint(best, best_path)


def load_file_state(components: Components, state: dict, path: str) -> None:
    """Load a single file's flat dict into ``components``; a CheckpointError names ``path``."""
    for component in components.values():
        try:
            component.load_state_dict(state)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None


def sharded_parts(components: Components) -> tuple[dict[str, Stateful], dict]:
    """The Stateful shard views DCP writes, and the small state extra.pt holds."""
    states, extra = {}, {}
    for name, c in components.items():
        if not c.sharded:
            extra.update(c.state_dict())
            continue
        extra.update(c.extra_state_dict())
        if (view := c.shards()) is not None:
            states[name] = view
    return states, extra


def load_sharded_state(components: Components, path: str) -> None:
    """Load a DCP folder into ``components``: small state first (checks before DCP reads), then the shards."""
    extra, states = shards.read_extra(path), {}
    for name, c in components.items():
        try:
            if c.sharded:
                c.load_extra_state_dict(extra)
            else:
                c.load_state_dict(extra)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if c.sharded and (view := c.shards()) is not None:
            states[name] = view
    shards.load_states(path, states)


__all__ = ["FORMATS", "Callable", "Component", "Format", "Sharded", "SingleFile", "format_of", "to_restore"]
