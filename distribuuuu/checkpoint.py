"""Checkpoints of either format, as the trainer and the tools take them: one file or a ``.dcp`` folder.

Above both formats (``single_file.py``, ``sharded_checkpoint.py``) and the checkpoints folder
(``checkpoint_names.py``), none of which imports this module: a checkpoint is loaded, verified,
found or pruned here whatever its format, and the names the package has always exported from
here (``save_checkpoint``, ``load_checkpoint``, ``CheckpointError``, ...) stay where they were.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from distribuuuu import sharded_checkpoint as shards
from distribuuuu.checkpoint_names import (  # noqa: F401  (re-exported)
    BEST_NAME,
    BEST_SHARDED,
    CKPT_DIR,
    checkpoint_name,
    checkpoint_position,
    list_checkpoints,
    prune,
)
from distribuuuu.checkpoint_names import find_resumable as _find_resumable
from distribuuuu.distributed import is_main_process
from distribuuuu.errors import CheckpointError  # noqa: F401  (re-exported)
from distribuuuu.single_file import load_file, model_state_from, save_checkpoint, state_checksum  # noqa: F401


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", verify: bool = True) -> dict:
    """Load a checkpoint with ``weights_only=True`` (no code from the file runs) and verify it.

    A sharded checkpoint (a ``.dcp`` directory) is read whole into this process, as the state a
    single file would hold: every tool that takes a checkpoint file takes one.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return shards.read_full_state(path, verify=verify)
    return load_file(path, map_location, verify)


def verify_checkpoint(path: str) -> None:
    """Raise CheckpointError if ``path`` (a file or a ``.dcp`` folder) does not load or fails verification."""
    shards.verify_sharded(path) if os.path.isdir(path) else load_file(path)


def find_resumable(ckpt_dir: str, verify: Callable[[str], object] = verify_checkpoint, fmt: str = "any") -> str | None:
    """Return the newest checkpoint of ``ckpt_dir`` that ``verify`` accepts (by default: it loads and
    verifies); move broken newer ones aside. Called on the main process only; the caller shares the path.
    """
    return _find_resumable(ckpt_dir, verify, fmt)


def prune_checkpoints(ckpt_dir: str, keep: int, fmt: str = "file") -> None:
    """Delete all but the newest ``keep`` checkpoints of format ``fmt``, and stale temporaries (main process only)."""
    if is_main_process():
        prune(ckpt_dir, keep, fmt)
