"""The checkpoints folder: names, their one order, listing, and what crashed saves left behind.

Both formats share one naming: ``ckpt_ep_003`` after epoch 3, ``ckpt_ep_004_it_000050`` 50 steps
into epoch 4, with ``.pth.tar`` for a single file and ``.dcp`` for a sharded (DCP) folder. The lister
(and through it ``checkpoint.find_resumable``, ``checkpoint.prune_checkpoints`` and the tools)
orders them through ``checkpoint_position``, so a run that changed format between starts still
resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import re

from distribuuuu.files import PART

CKPT_DIR = "checkpoints"
BEST_NAME = "best.pth.tar"  # the best weights as one file
BEST_SHARDED = "best.dcp"  # under sharded checkpoints: the best weights (and EMA), no optimizer
FILE, SHARDED = ".pth.tar", ".dcp"
FORMATS = {"file": (FILE,), "sharded": (SHARDED,), "any": (FILE, SHARDED)}
_NAME = re.compile(r"^ckpt_ep_(\d+)(?:_it_(\d+))?(\.pth\.tar|\.dcp)$")
# Temporaries a crash mid-save leaves: files.py's ``.<name>.<random>.part``, and the ``<name>.tmp.<pid>``
# and ``<name>.old.<pid>`` of earlier versions (old runs leave them behind too).
_TEMPORARY = re.compile(
    r"^(\.ckpt_ep_\d+(_it_\d+)?(\.pth\.tar|\.dcp)\..+" + re.escape(PART) + r"|ckpt_ep_.+\.(tmp|old)\.\d+)$"
)


def checkpoint_name(epoch: int, step_in_epoch: int = 0, sharded: bool = False) -> str:
    """``ckpt_ep_003.pth.tar`` after epoch 3; ``ckpt_ep_004_it_000050.pth.tar`` 50 steps into epoch 4.

    ``epoch`` is 1-based: the epoch that finished, or the one in progress; ``sharded`` gives the
    ``.dcp`` folder's name.
    """
    stem = f"ckpt_ep_{epoch:03d}" + (f"_it_{step_in_epoch:06d}" if step_in_epoch else "")
    return stem + (SHARDED if sharded else FILE)


def checkpoint_position(name: str) -> tuple[int, int] | None:
    """(epoch, step) a checkpoint's name stands for, to sort by; None if ``name`` is not a checkpoint's.

    An epoch-end checkpoint of epoch e comes after every mid-epoch one of epoch e.
    """
    match = _NAME.match(os.path.basename(os.path.normpath(name)))
    if match is None:
        return None
    epoch, step, _ = match.groups()
    return int(epoch), int(step) if step else 1 << 62


def list_checkpoints(ckpt_dir: str, fmt: str = "file", prefer: str = FILE) -> list[str]:
    """Checkpoint paths in ``ckpt_dir``, oldest first: ``fmt`` "file", "sharded" or "any" (temporaries never).

    Both formats of one position (a file converted to a .dcp folder, or back) sort the ``prefer``
    one (FILE or SHARDED) last, as the newer: the one a resume takes."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = [n for n in os.listdir(ckpt_dir) if n.endswith(FORMATS[fmt]) and checkpoint_position(n)]
    return [
        os.path.join(ckpt_dir, n) for n in sorted(names, key=lambda n: (checkpoint_position(n), n.endswith(prefer)))
    ]


def stale_temporaries(ckpt_dir: str) -> list[str]:
    """What crashed saves left in ``ckpt_dir`` (either format, any naming this package ever used)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return [os.path.join(ckpt_dir, n) for n in sorted(os.listdir(ckpt_dir)) if _TEMPORARY.match(n)]
