"""Single-file checkpoints: atomic, checksummed writes on rank 0; safe (weights_only) loads."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from collections import OrderedDict
from typing import Any

import torch

from distribuuuu.checkpointing.file_kind import describe_non_checkpoint
from distribuuuu.errors import CheckpointError, RefusedCheckpointError, refused_global
from distribuuuu.files import atomic_write, write_failure
from distribuuuu.runtime.process_group import is_main_process


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
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the buffer itself, not a copy
    return digest.hexdigest()


def weights_digest(weights: dict) -> str:
    """SHA-256 over the bytes of every tensor of ``weights``, by sorted name: the checkpoint checksum's hash."""
    return state_checksum({"model": weights})


def save_checkpoint(state: dict, path: str) -> None:
    """Write ``state`` to ``path`` atomically on the main process (other ranks return at once).

    files.atomic_write writes beside the target, syncs, then renames over it: a crash or a full
    disk mid-write leaves the previous file untouched and no temporary behind.
    """
    if not is_main_process():
        return
    state = dict(state, checksum=state_checksum(state))
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with atomic_write(path) as f:  # a file object: torch.save then keeps the OSError of a full disk
            try:
                torch.save(state, f)
            except Exception as e:  # described while the partial file still takes its room
                _raise_write_failure(e, path, folder)
    except OSError as e:  # the last flush, the sync or the rename
        _raise_write_failure(e, path, folder)


def _raise_write_failure(e: Exception, path: str, folder: str) -> None:
    """Raise a one-line CheckpointError naming the cause when it is known (a full disk); else ``e`` itself."""
    cause = write_failure(e, folder)
    if cause is None:
        raise e
    raise CheckpointError(f"could not write checkpoint {path}: {cause}; earlier checkpoints are intact") from None


def refusal(path: str, e: pickle.UnpicklingError) -> str:
    """Why ``path`` is not loaded: ``weights_only=True`` refused an object (a file's or a DCP entry's),
    named as torch names it ("GLOBAL posix.system"), without the terminal escapes of torch's text."""
    return f"refusing to load {path}: it holds objects that weights_only=True does not allow ({refused_global(e)})"


def no_pickle(e: pickle.UnpicklingError) -> str | None:
    """The byte torch's weights-only unpickler met that is no pickle opcode (a damaged file, not a
    refused object), as torch names it ("Unsupported operand 120"); None for a refusal."""
    found = re.search(r"Unsupported operand \d+", str(e))
    return found.group(0) if found else None


def load_file(path: str, map_location: str | torch.device = "cpu", verify: bool = True) -> dict:
    """Load a checkpoint file with ``weights_only=True`` (no code from the file runs) and verify its checksum."""
    what = describe_non_checkpoint(path)
    if what is not None:  # before torch.load, whose refusal would suggest an unsafe load of it
        raise RefusedCheckpointError(f"{path} is not a checkpoint ({what})")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except pickle.UnpicklingError as e:
        if no_pickle(e):
            raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt?): {no_pickle(e)}") from None
        raise RefusedCheckpointError(
            f"{refusal(path, e)}; if you trust its source, convert it once as docs/fault-tolerance.md ('Safe loading') shows"
        ) from None
    except Exception as e:
        raise CheckpointError(  # its cause kept: an I/O error is the machine's, not the file's (named_by)
            f"checkpoint {path} is unreadable (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a dict")
    if verify and "checksum" in state and state_checksum(state) != state["checksum"]:
        raise CheckpointError(f"checkpoint {path} fails its checksum: the file is corrupt")
    return state


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
    return unwrapped(weights)


_WRAPPER_PREFIX = re.compile(r"^(module\.|_orig_mod\.)+")
_WRAPPER_MODULE = re.compile(r"^((module|_orig_mod)(\.|$))+")  # module paths: "module" is the wrapped model itself


def unwrapped(weights: dict) -> dict:
    """``weights`` without DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes; the
    module versions that ``state_dict()`` records (``_metadata``) keep up with the names."""
    out = OrderedDict((_WRAPPER_PREFIX.sub("", k), v) for k, v in weights.items())
    metadata = getattr(weights, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict((_WRAPPER_MODULE.sub("", k), v) for k, v in metadata.items())
    return out
