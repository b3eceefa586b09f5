"""Checkpoints: atomic, checksummed writes on rank 0; safe (weights_only) loads; resume fallback."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
from typing import Any, Callable

import torch

from distribuuuu.distributed import is_main_process
from distribuuuu.errors import first_line, os_error_in

logger = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
BEST_NAME = "best.pth.tar"
_NAME = re.compile(r"^ckpt_ep_(\d+)(?:_it_(\d+))?\.pth\.tar$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read, verified or trusted; the message names the file."""


def checkpoint_name(epoch: int, step_in_epoch: int = 0) -> str:
    """``ckpt_ep_003.pth.tar`` after epoch 3; ``ckpt_ep_004_it_000050.pth.tar`` 50 steps into epoch 4.

    ``epoch`` is 1-based: the epoch that finished, or the one in progress.
    """
    return (
        f"ckpt_ep_{epoch:03d}.pth.tar" if step_in_epoch == 0 else f"ckpt_ep_{epoch:03d}_it_{step_in_epoch:06d}.pth.tar"
    )


def _order(name: str) -> tuple[int, int]:
    epoch, step = _NAME.match(name).groups()
    # An epoch-end checkpoint of epoch e comes after every mid-epoch one of epoch e.
    return (int(epoch), int(step) if step else 1 << 62)


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """Checkpoint paths in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = sorted((n for n in os.listdir(ckpt_dir) if _NAME.match(n)), key=_order)
    return [os.path.join(ckpt_dir, n) for n in names]


def _tensors(obj: Any):
    """Yield every tensor in a nested dict/list structure, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def state_checksum(state: dict) -> str:
    """SHA-256 over the bytes of every tensor in the model/EMA/optimizer state.

    torch.load accepts a file with flipped bits in tensor data without complaint; this catches it.
    """
    digest = hashlib.sha256()
    for t in _tensors({k: state.get(k) for k in ("model", "ema", "optimizer")}):
        t = t.detach().cpu().contiguous().reshape(-1)
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_checkpoint(state: dict, path: str) -> None:
    """Write ``state`` to ``path`` atomically on the main process (other ranks return at once).

    The file is written beside the target, flushed to disk, then renamed over it: a crash or a
    full disk mid-write leaves the previous file untouched.
    """
    if not is_main_process():
        return
    state = dict(state, checksum=state_checksum(state))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # also KeyboardInterrupt: never leave a half-written temp file
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = os_error_in(e)  # torch.save raises a RuntimeError while handling the OSError of a full disk
        if cause is not None:
            raise CheckpointError(
                f"could not write checkpoint {path}: {cause}; earlier checkpoints are intact"
            ) from None
        raise


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", verify: bool = True) -> dict:
    """Load a checkpoint with ``weights_only=True`` (no code from the file runs) and verify it.

    A sharded checkpoint (a ``.dcp`` directory) is read whole into this process, as the state a
    single file would hold: every tool that takes a checkpoint file takes one.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        from distribuuuu.sharded_checkpoint import read_full_state

        return read_full_state(path, verify=verify)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: it holds objects that weights_only=True does not allow "
            f"({first_line(e)[:200]}); if you trust its source, convert it once as the "
            "README ('Safe loading') shows"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a dict")
    if verify and "checksum" in state and state_checksum(state) != state["checksum"]:
        raise CheckpointError(f"checkpoint {path} fails its checksum: the file is corrupt")
    return state


def find_resumable(
    ckpt_dir: str,
    listing: Callable[[str], list[str]] = list_checkpoints,
    verify: Callable[[str], object] | None = None,
) -> str | None:
    """Return the newest checkpoint that loads and verifies; move broken newer ones aside.

    ``listing`` and ``verify`` default to single-file checkpoints (``load_checkpoint``); sharded
    ones pass their own. Called on the main process only; the caller shares the chosen path.
    """
    verify = verify or load_checkpoint
    for path in reversed(listing(ckpt_dir)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            aside = path + ".corrupt"
            os.replace(path, aside)
            logger.warning("%s; moved it aside to %s and trying the previous checkpoint", e, aside)
    return None


def prune_checkpoints(ckpt_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (main process only)."""
    if not is_main_process():
        return
    for path in list_checkpoints(ckpt_dir)[:-keep]:
        os.remove(path)


def model_state_from(state: dict, kind: str = "model") -> dict:
    """The model weights of a checkpoint (or of a bare state_dict), without wrapper prefixes.

    ``kind`` picks the raw weights ("model") or the averaged ones ("ema"). ``module.`` (DDP) and
    ``_orig_mod.`` (torch.compile) prefixes are stripped.
    """
    if kind == "ema":
        if not state.get("ema"):
            raise CheckpointError("MODEL.WEIGHTS_KIND is 'ema' but the checkpoint holds no EMA weights")
        weights = state["ema"]["module"]
    elif "model" in state and isinstance(state["model"], dict):
        weights = state["model"]
    elif "state_dict" in state:
        weights = state["state_dict"]
    else:
        weights = state
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in weights.items()}
