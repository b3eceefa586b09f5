"""Checkpoints of either format, as the trainer and the tools take them: one file or a ``.dcp`` folder.

Above both formats' files (``single_file.py``, ``sharded.py``) and the checkpoints folder
(``names.py``), none of which imports this module. The one front door for each operation on a
checkpoint as a tool takes it, whatever its format: ``save_checkpoint`` (a single file),
``load_checkpoint``, ``verify_checkpoint``, ``find_resumable``, ``prune_checkpoints``,
``list_checkpoints``. A run's checkpoints go through its Checkpointer (``manager.py``). The names
the package has always exported from here stay here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Callable

import torch

from distribuuuu.checkpointing import sharded as shards
from distribuuuu.checkpointing.file_kind import describe_non_checkpoint
from distribuuuu.checkpointing.names import (  # noqa: F401  (re-exported)
    BEST_NAME,
    BEST_SHARDED,
    CKPT_DIR,
    FILE,
    SHARDED,
    checkpoint_name,
    checkpoint_position,
    list_checkpoints,
    stale_temporaries,
)
from distribuuuu.checkpointing.single_file import (  # noqa: F401
    load_file,
    model_state_from,
    save_checkpoint,
    state_checksum,
    weights_digest,
)
from distribuuuu.errors import CheckpointError, ConfigError, RefusedCheckpointError
from distribuuuu.runtime.process_group import is_main_process

logger = logging.getLogger(__name__)


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", verify: bool = True) -> dict:
    """Load a checkpoint with ``weights_only=True`` (no code from the file runs) and verify it.

    A sharded checkpoint (a ``.dcp`` directory) is read whole into this process, as the state a
    single file would hold: every tool that takes a checkpoint file takes one.
    """
    if isinstance(map_location, torch.nn.Module):  # the original Distribuuuu's load_checkpoint(path, model)
        raise TypeError(
            "load_checkpoint(path, map_location) returns the checkpoint's dict: load a model with "
            "model.load_state_dict(load_checkpoint(path)['model'])"
        )
    path = os.fspath(path)
    if os.path.isdir(os.path.join(path, CKPT_DIR)):  # a run's folder, given where its checkpoint was meant
        best = [os.path.join(path, b) for b in (BEST_NAME, BEST_SHARDED) if os.path.exists(os.path.join(path, b))]
        raise CheckpointError(
            f"{path} is a run's OUT_DIR, not a checkpoint: give {' or '.join([*best, 'one of'])} "
            f"{os.path.join(path, CKPT_DIR)}"
        )
    if os.path.isdir(path):
        what = describe_non_checkpoint(path)
        if what is not None:
            raise RefusedCheckpointError(f"{path} is not a checkpoint ({what})")
        return shards.read_full_state(path, verify=verify)
    return load_file(path, map_location, verify)


@contextlib.contextmanager
def named_by(key: str) -> Iterator[None]:
    """A checkpoint a config key names that is not there, does not load or does not fit is bad input:
    its CheckpointError becomes a ConfigError naming ``key`` (one line, exit 2). One the machine
    failed to read (an I/O error, no memory) stays what it is: a failed run, exit 1."""
    try:
        yield
    except CheckpointError as e:
        if isinstance(e.__cause__, (OSError, MemoryError)):
            raise
        raise ConfigError(f"{key}: {e}") from None


def verify_checkpoint(path: str) -> None:
    """Raise CheckpointError if ``path`` (a file or a ``.dcp`` folder) does not load or fails verification."""
    shards.verify_sharded(path) if os.path.isdir(path) else load_file(path)


def find_resumable(
    ckpt_dir: str, verify: Callable[[str], object] = verify_checkpoint, fmt: str = "any", prefer: str = FILE
) -> str | None:
    """The newest checkpoint of ``ckpt_dir`` (of format ``fmt``; of both at one position, ``prefer``)
    that ``verify`` accepts; broken newer ones moved aside.

    ``verify`` (by default: it loads and verifies) raises CheckpointError on a checkpoint that does
    not load or verify. One it refuses (RefusedCheckpointError: it would run code, or is no
    checkpoint) is no torn write: it stops the run there, left in place. Called on the main process
    only; the caller shares the chosen path.
    """
    for path in reversed(list_checkpoints(ckpt_dir, fmt, prefer)):
        try:
            verify(path)
            return path
        except RefusedCheckpointError:
            raise
        except CheckpointError as e:
            aside = path + ".corrupt"
            os.replace(path, aside)
            logger.warning("%s; moved it aside to %s and trying the previous checkpoint", e, aside)
    return None


def prune_checkpoints(ckpt_dir: str, keep: int, fmt: str = "file") -> None:
    """Delete all but the newest ``keep`` checkpoints of format ``fmt``, and every stale temporary.

    The main process alone (elsewhere a no-op), between saves: a save in progress is never pruned
    concurrently. A failed removal is a CheckpointError naming the folder.
    """
    if not is_main_process():
        return
    try:
        for path in list_checkpoints(ckpt_dir, fmt)[:-keep]:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        for path in stale_temporaries(ckpt_dir):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    except OSError as e:
        raise CheckpointError(f"could not remove an old checkpoint in {ckpt_dir}: {e}") from None
