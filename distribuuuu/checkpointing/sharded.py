"""Sharded checkpoints with Distributed Checkpoint (DCP): each rank writes its own shard.

A checkpoint is a directory ``ckpt_ep_003.dcp`` (``ckpt_ep_004_it_000050.dcp`` mid-epoch) holding
DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files (model, optimizer, EMA tensors), ``extra.pt``
(epoch, step, cfg, classes, per-rank RNG, scaler: small, non-tensor state) and ``manifest.json``:
the size and SHA-256 of every other file, written last. It is written under a temporary name and
moved into place by rank 0 (``files.replace_dir``) once every rank has finished and the manifest
is on disk, so a crash leaves no directory with the final name; ``verify_sharded`` then rejects a
directory whose files do not match the manifest (truncated, missing, flipped bits). Nothing is ever gathered on one rank.

DCP reshards on load: a checkpoint saved by W ranks loads into any number of ranks, sharded
(FSDP2) or not (DDP, one process).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from distribuuuu.checkpointing.dcp_reader import METADATA, CheckedReader, is_plain_name, read_metadata
from distribuuuu.checkpointing.single_file import load_file, refusal
from distribuuuu.errors import CheckpointError, RefusedCheckpointError, first_line
from distribuuuu.files import atomic_write, replace_dir, temporary_name, write_failure
from distribuuuu.runtime.process_group import (
    all_gather_object,
    broadcast_object,
    get_rank,
    is_main_process,
)

logger = logging.getLogger(__name__)

MANIFEST, EXTRA = "manifest.json", "extra.pt"


def _file_digest(path: str) -> dict:
    """Size and SHA-256 of a file, read in 1 MiB pieces (a shard may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _own_files(directory: str, rank: int) -> dict[str, dict]:
    """Digests of the shard files this rank wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    names = sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".distcp"))
    return {n: _file_digest(os.path.join(directory, n)) for n in names}


def save_states(path: str, states: dict[str, Stateful], extra: dict) -> None:
    """Write a sharded checkpoint to the directory ``path``; every rank calls this (collective).

    DCP writes the Stateful ``states``, each rank its own shard files, which it hashes; rank 0
    writes ``extra`` (small, non-tensor state) and the manifest, then moves the temporary folder
    to ``path``. Raises CheckpointError on every rank if any rank failed.
    """
    tmp = broadcast_object(_temporary_folder(path) if is_main_process() else None)  # one folder for all
    error = None
    try:
        dcp.save(states, checkpoint_id=tmp)
    # DCP's CheckpointException is a BaseException: named here, or it would escape with its traceback.
    except (Exception, CheckpointException) as e:  # reported collectively below: peers must not wait
        error = e
    _finish_collectively(tmp, path, extra, error)


def start_saving_states(path: str, states: dict[str, Stateful], extra: dict, group) -> Callable[[], None]:
    """Copy ``states`` to host memory and start writing them (DCP's ``async_save`` over ``group``, a
    process group of its own: its collectives run beside training's); every rank calls this.

    Returns what finishes the checkpoint as ``save_states`` does (waits for DCP's write, then the
    manifest and the rename; collective over ``group``), for a background thread to run.
    """
    tmp = broadcast_object(_temporary_folder(path) if is_main_process() else None)
    upload = dcp.async_save(states, checkpoint_id=tmp, process_group=group)  # staged (copied) when it returns

    def finish() -> None:
        error = None
        try:
            upload.result()
        except (Exception, CheckpointException) as e:  # reported collectively: peers must not wait
            error = e
        _finish_collectively(tmp, path, extra, error, group)

    return finish


def _finish_collectively(tmp: str, path: str, extra: dict, error: BaseException | None, group=None) -> None:
    """Every rank hashes its shard files; rank 0 writes the manifest and moves ``tmp`` to ``path``,
    or every rank raises the first rank's error (a CheckpointError)."""
    rank, files = get_rank(), {}
    if error is None:
        try:
            files = _own_files(tmp, rank)
        except OSError as e:
            error = e
    message = None
    if error is not None:
        message = (
            f"rank {rank} could not write its shard of {path}: {_write_failure(error, rank, os.path.dirname(tmp))}"
        )
    gathered = all_gather_object((message, files), group)
    errors = [e for e, _ in gathered if e]
    if not errors and is_main_process():
        manifest = {name: d for _, f in gathered for name, d in f.items()}
        errors = _finish(tmp, path, manifest, extra)
    errors = broadcast_object(errors, group=group)
    if errors:
        if is_main_process():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{errors[0]}; earlier checkpoints are intact")


def _temporary_folder(path: str) -> str:
    """files.py's temporary name beside ``path`` (``.<name>.<random>.part``), its folder created if need be."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return temporary_name(path)


def _write_failure(e: BaseException, rank: int, folder: str) -> str:
    """One line for a failed write into ``folder``: its cause (a full disk) where known (files.write_failure).

    DCP gathers every rank's error into a CheckpointException (this rank's first, if it failed).
    """
    if isinstance(e, CheckpointException) and e.failures:
        e = (e.failures.get(rank) or next(iter(e.failures.values())))[0]
    return write_failure(e, folder) or f"{type(e).__name__}: {first_line(e)}"


def _finish(tmp: str, path: str, manifest: dict, extra: dict) -> list[str]:
    """Rank 0: write extra.pt and the manifest (last), then move ``tmp`` to ``path`` atomically."""
    try:
        with open(os.path.join(tmp, EXTRA), "wb") as f:  # a file object: torch.save then keeps the OSError
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
        manifest[METADATA] = _file_digest(os.path.join(tmp, METADATA))
        manifest[EXTRA] = _file_digest(os.path.join(tmp, EXTRA))
        # Inside the temporary folder already; atomic_write syncs the file and the folder.
        with atomic_write(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"files": manifest}, f, indent=1, sort_keys=True)
        replace_dir(tmp, path)  # a re-save of the same step: the old one goes only once the new is whole
    except Exception as e:  # returned, not raised: the other ranks wait for rank 0's verdict
        return [f"could not write checkpoint {path}: {_write_failure(e, 0, os.path.dirname(tmp))}"]
    return []


def verify_sharded(path: str, checksums: bool = True) -> None:
    """Raise CheckpointError naming the first file of ``path`` that is missing or differs from the manifest,
    or a metadata that is no DCP metadata (a RefusedCheckpointError: one that would run code).

    The checksums find a torn or damaged file, not a crafted one: whoever can write the folder can
    rewrite the manifest. What keeps a crafted folder from running code is how it is read
    (``dcp_reader.read_metadata``, ``weights_only=True``)."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        raise CheckpointError(f"sharded checkpoint {path} has no {MANIFEST}: it was not finished") from None
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable: {type(e).__name__}: {e}") from None
    for name in (METADATA, EXTRA):
        if name not in files:
            raise CheckpointError(f"{manifest_path} does not list {name}")
    for name, expected in sorted(files.items()):
        if not is_plain_name(name):  # "/etc/shadow" or "../x": verifying would read files elsewhere
            raise CheckpointError(f"{manifest_path} names {name!r}, not a file of {path}")
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"sharded checkpoint {path}: {file} is missing")
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} holds {size} bytes, the manifest {expected['bytes']}: truncated or damaged")
        if checksums and _file_digest(file)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{file} fails its SHA-256 checksum: the file is corrupt")
    read_metadata(path)


def read_extra(path: str) -> dict:
    """The non-tensor state of a sharded checkpoint, read as a checkpoint file is (weights_only: no code from it runs)."""
    return load_file(os.path.join(path, EXTRA), verify=False)


def load_states(path: str, states: dict[str, Stateful]) -> dict:
    """Load ``path`` into the Stateful ``states`` (collective); return the extra state.

    The world size and the sharding may differ from the saving run's: DCP reads, for each local
    shard, the pieces of the saved shards that overlap it. Verify first (``verify_sharded``, on
    rank 0 when the checkpoint to resume is chosen): DCP itself does not notice a damaged shard.
    """
    reader = CheckedReader(path)  # its metadata checked (a refusal raised) before DCP reads anything
    try:
        dcp.load(states, storage_reader=reader, planner=_WeightsOnlyLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP gathers the ranks' errors in a BaseException
        raise _read_failure(e, path, "load") from None
    return read_extra(path)


class _WeightsOnlyBytes:
    """DCP unpickles a checkpoint's non-tensor entries with ``weights_only=False``, which runs any
    code a crafted file holds. These planners unpickle each one with ``weights_only=True`` first, as
    every checkpoint file is loaded, and hand DCP a copy pickled again from the result (small:
    optimizer hyper-parameters and the like). A refused entry fails the load (``_read_failure``)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        checked, safe = torch.load(value, map_location="cpu", weights_only=True), io.BytesIO()
        torch.save(checked, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


class _WeightsOnlyLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner with its non-tensor entries unpickled by ``weights_only=True``."""


def _read_failure(e: BaseException, path: str, verb: str) -> CheckpointError:
    """One line for a failed DCP read of ``path``; an entry that would run code is refused as a file's is."""
    if isinstance(e, CheckpointException) and e.failures:  # every rank's error, gathered by DCP
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, pickle.UnpicklingError):
        return RefusedCheckpointError(refusal(path, e))
    return CheckpointError(f"could not {verb} sharded checkpoint {path}: {type(e).__name__}: {first_line(e)}")


def _optimizer_by_index(optim_state: dict) -> dict:
    """DCP's optimizer state (keyed by parameter name) in ``Optimizer.state_dict()``'s form (by index).

    ``get_state_dict`` lists each group's parameters by name in the optimizer's own order, which
    is the order ``Optimizer.state_dict()`` numbers them in.
    """
    names = [name for group in optim_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: s for name, s in optim_state["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in optim_state["param_groups"]],
    }


def read_full_state(dcp_dir: str, verify: bool = True) -> dict:
    """A sharded checkpoint as today's single-file state dict, in this process's memory (no process group).

    What ``load_checkpoint`` returns for a ``.dcp`` directory: evaluation, prediction, MODEL.WEIGHTS
    and the conversion tool read either format through it. The whole state is read into memory:
    for tools and weights, not for resuming a sharded run (``load_states`` does that shard by shard).
    """
    if verify:
        verify_sharded(dcp_dir)
    reader = CheckedReader(dcp_dir)  # its metadata checked (a refusal raised) before DCP reads anything
    try:
        tensors = _read_whole(reader)
    except (Exception, CheckpointException) as e:
        raise _read_failure(e, dcp_dir, "read") from None
    extra = read_extra(dcp_dir)
    state = dict(extra, model=tensors["model"], ema=None)
    state["optimizer"] = _optimizer_by_index(tensors["optimizer"]) if "optimizer" in tensors else None
    if "ema" in tensors:
        state["ema"] = {"module": tensors["ema"], "updates": extra.get("ema_updates", 0)}
    state.pop("ema_updates", None)
    return state


def _read_whole(reader: CheckedReader) -> dict:
    """Every entry of a DCP checkpoint as a nested dict of plain tensors, read into this process.

    The body of torch's public ``format_utils.dcp_to_torch_save`` without its ``torch.save``: that
    converter only writes to a file, and reading its file back would need the checkpoint's size free
    in TMPDIR (often a small file system on cluster nodes) and the bytes read twice. The two names
    are private to torch; tests/unit/checkpointing/test_sharded_checkpoint.py reads a checkpoint through them.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class WholeStatePlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
        """The planner of torch's converter, with the non-tensor entries unpickled by ``weights_only=True``."""

    state: dict = {}
    _load_state_dict(state, reader, planner=WholeStatePlanner(), no_dist=True)
    return state
