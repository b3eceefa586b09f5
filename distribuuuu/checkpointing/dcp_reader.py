"""A DCP folder's ``.metadata`` read without running code, and the one reader every DCP read goes through.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with a plain ``pickle.load``
(torch 2.11 to 2.15 alike), before anything else of the folder is read: a crafted file runs
whatever code it holds, and the manifest's SHA-256 of it is the attacker's to rewrite. torch leaves
DCP to trusted environments (its SECURITY.md; pytorch issue 189308 is open, and a restricted
unpickler, pytorch PR 191326, was closed unmerged), so the metadata is unpickled here by a
``pickle.Unpickler`` whose ``find_class`` returns only what DCP metadata is made of (Python's own
way to restrict globals). torch's weights-only unpickler is private and has its own rules for
reconstructing objects; the classes below are few, and each one's reconstruction only stores data.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from distribuuuu.errors import CheckpointError, RefusedCheckpointError, first_line

METADATA = ".metadata"


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a ``.metadata`` of torch 2.11-2.15 holds, by (module, name): found by unpickling
    the metadata of model, optimizer and EMA shards (one process; FSDP2 DTensors over 2 ranks) and
    read off torch/distributed/checkpoint/metadata.py and filesystem.py of each release."""
    classes = (
        dcp_metadata.Metadata,  # the whole: state_dict_metadata, planner_data, storage_data, storage_meta, version
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,  # a non-tensor entry (optimizer hyper-parameters)
        dcp_metadata.ChunkStorageMetadata,  # one shard's offsets and sizes
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,  # TensorProperties pickles its memory format as this enum
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
    )
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__name__): c for c in classes}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo  # where each entry lies
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    # torch pickles a layout as _get_layout("torch.strided"): a lookup in torch's own layouts.
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # StorageMeta.checkpoint_id: the folder FileSystemWriter wrote to, a Path (pathlib._local from Python 3.13).
    for module in ("pathlib", "pathlib._local"):
        allowed.update({(module, c.__name__): c for c in (pathlib.PosixPath, pathlib.PurePosixPath)})
    return allowed


_ALLOWED = _metadata_globals()


class _RefusedGlobal(pickle.UnpicklingError):
    """A global that DCP metadata never holds; the message is how torch names one ("GLOBAL posix.system")."""


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused before it is imported.

    The pure-Python unpickler, not the C one: the C one sizes its memo by the largest index a file
    names, so a 20-byte crafted file has it allocate and zero gigabytes (the fuzzing test met
    this). It is slower (0.2 s for the 200 KB metadata of resnet50 with AdamW, against 0.02 s), once a load.
    """

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]  # an exact pair: no import, no dotted attribute walk
        except KeyError:
            raise _RefusedGlobal(f"GLOBAL {module}.{name}") from None


def read_metadata(folder: str) -> Metadata:
    """``folder``'s DCP metadata, unpickled by the restricted unpickler and checked: a
    RefusedCheckpointError for a global it never holds, a CheckpointError for anything else amiss."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as f:
            data = f.read()  # in memory: a crafted length in the pickle cannot ask for more than the file
    except FileNotFoundError:
        raise CheckpointError(f"sharded checkpoint {folder} has no {METADATA}") from None
    except OSError as e:  # the machine's failure, not the file's (checkpoint.named_by keeps it one)
        raise CheckpointError(f"could not read {path}: {e}") from e
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as e:
        raise RefusedCheckpointError(
            f"refusing to load {folder}: its {METADATA} holds a global that DCP metadata never holds ({e})"
        ) from None
    except Exception as e:  # a damaged pickle fails in many ways: EOFError, ValueError, struct errors, ...
        raise CheckpointError(
            f"{path} is unreadable (truncated or corrupt?): {type(e).__name__}: {first_line(e)}"
        ) from None
    _check_structure(metadata, folder)
    return metadata


def _check_structure(metadata: Any, folder: str) -> None:
    """Raise a CheckpointError unless ``metadata`` is DCP metadata whose entries all lie in files of ``folder``."""
    path = os.path.join(folder, METADATA)
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, Metadata)
        and isinstance(getattr(metadata, "state_dict_metadata", None), dict)
        and isinstance(storage, dict)
        and isinstance(getattr(metadata, "storage_meta", None), (StorageMeta, type(None)))
    ):
        raise CheckpointError(f"{path} does not hold DCP metadata (a {type(metadata).__name__})")
    for where in storage.values():
        if not isinstance(where, _StorageInfo):
            raise CheckpointError(f"{path} does not hold DCP metadata (an entry's place is a {type(where).__name__})")
        if not is_plain_name(where.relative_path):
            shown = where.relative_path if isinstance(where.relative_path, str) else type(where.relative_path).__name__
            raise CheckpointError(f"{path} places an entry outside {folder}: {shown[:200]!r}")


def is_plain_name(name: object) -> bool:
    """A file name of the folder itself: no separator, not the folder or its parent (an absolute
    path or ``..`` in a crafted file would have a read leave the folder)."""
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name and "\0" not in name


class CheckedReader(FileSystemReader):
    """torch's FileSystemReader with ``read_metadata``'s metadata, read once when it is made: DCP
    then reads no ``.metadata`` itself (and so never unpickles one unchecked, nor a newer one)."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self.metadata = read_metadata(folder)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.metadata = read_metadata(os.fspath(checkpoint_id))

    # No **kwargs, unlike torch's: DCP then never falls back to a rank's own __<rank>.metadata.
    def read_metadata(self) -> Metadata:
        """The checked metadata, with this load's id, as torch's own reader returns it."""
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata
