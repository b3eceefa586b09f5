"""Disk full: a failed checkpoint write leaves the previous file and no temporary, a run whose disk fills
during a checkpoint stops in one line and loses nothing, a full file system is named whatever torch says,
and a sharded checkpoint is read whole with no room in TMPDIR."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fault_helpers import DIGITS, _tiny_state
from helpers import FAST, PlainState

from distribuuuu import cli, trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from distribuuuu.checkpointing.sharded import save_states
from distribuuuu.files import write_failure

pytestmark = pytest.mark.usefixtures("plain_logging")


class _FullDisk:
    """A file that takes ``room`` bytes, then fails each write with ENOSPC, as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _fill_disk_in_torch_save(monkeypatch, room: int = 1000) -> dict:
    """Make the real torch.save write into a disk with ``room`` bytes left once ``state["full"]`` is set.

    torch.save then fails as it does on a full disk (torch 2.15: a RuntimeError "unexpected pos"
    of its zip writer, raised while handling the OSError), for single files and DCP's shards alike.
    """
    real_save, state = torch.save, {"full": False}

    def save(obj, f, *args, **kwargs):
        if state["full"]:
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as file:
                    return real_save(obj, _FullDisk(file, room), *args, **kwargs)
            f = _FullDisk(f, room)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return state


def test_failed_checkpoint_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / ckpt.checkpoint_name(1)
    save_checkpoint(_tiny_state(1.0), str(path))
    before = path.read_bytes()
    _fill_disk_in_torch_save(monkeypatch)["full"] = True
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {re.escape(str(path))}.*No space left"):
        save_checkpoint(_tiny_state(2.0), str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "no temp file left behind"
    assert load_checkpoint(str(path))["epoch"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_disk_full_during_a_checkpoint_stops_the_run_in_one_line_and_loses_nothing(tmp_path, monkeypatch, capsys, fmt):
    disk = _fill_disk_in_torch_save(monkeypatch)
    real_save_checkpoint = trainer.save_training_checkpoint

    def first_fits(run, checkpoints, *args, **kwargs):  # the disk fills up after the first checkpoint
        path = real_save_checkpoint(run, checkpoints, *args, **kwargs)
        checkpoints.wait()  # the first one is on disk: the next (background) write fails
        disk["full"] = True
        return path

    monkeypatch.setattr(trainer, "save_training_checkpoint", first_fits)
    out = tmp_path / "out"
    args = ["OUT_DIR", str(out), *FAST, "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "OPTIM.MAX_EPOCH", "1"]
    args += ["TRAIN.CKPT_PERIOD_ITERS", "1", "DIST.CKPT_FORMAT", fmt]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("distribuuuu: error:")]
    suffix = ".pth.tar" if fmt == "file" else ".dcp"
    failed = out / "checkpoints" / f"{ckpt.checkpoint_name(1, 2).removesuffix('.pth.tar')}{suffix}"
    assert len(errors) == 1 and str(failed) in errors[0] and "No space left on device" in errors[0], err[-3000:]
    assert "Traceback" not in err
    first = f"{ckpt.checkpoint_name(1, 1).removesuffix('.pth.tar')}{suffix}"
    assert sorted(os.listdir(out / "checkpoints")) == [first], "no temporary file or directory left behind"
    monkeypatch.undo()
    resumed = load_checkpoint(str(out / "checkpoints" / first))
    assert (resumed["epoch"], resumed["step_in_epoch"]) == (0, 1)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 4 MiB file system (tmpfs) at ``tmp_path/disk``, unmounted after; skipped where mount is refused."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small file system here (root only): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path, leave: int = 64 << 10) -> None:
    """Take all but ``leave`` bytes of the file system of ``disk`` with one file."""
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def test_a_full_file_system_is_named_whatever_torch_says(small_disk):
    """A short write that torch reports without the OSError underneath (torch 2.14's zip writer
    writing to a path) is put down to the full file system it went to, with its free bytes."""
    _fill(small_disk, leave=0)
    try:
        with open(small_disk / "part", "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
    except OSError:
        pass
    from_torch = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    said = write_failure(from_torch, str(small_disk))
    assert said is not None and said.startswith("No space left on device (") and str(small_disk) in said, said
    (small_disk / "filler").unlink()  # room again: the same error is no longer a full disk
    assert write_failure(from_torch, str(small_disk)) is None


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_checkpoint_into_a_full_file_system_fails_in_one_line_and_keeps_the_last_one(small_disk, fmt):
    state = {"model": {"w": torch.arange(64 << 10, dtype=torch.float32)}, "epoch": 1}  # 256 KiB
    first, second = small_disk / f"ckpt_1.{fmt}", small_disk / f"ckpt_2.{fmt}"
    save = save_checkpoint if fmt == "file" else save_states_of
    save(state, str(first))
    _fill(small_disk)
    with pytest.raises(CheckpointError) as e:
        save(dict(state, epoch=2), str(second))
    assert "\n" not in str(e.value) and f"{second}" in str(e.value), str(e.value)
    assert re.search(r"No space left on device \(\d[\d,]* bytes free on the file system of ", str(e.value)), str(
        e.value
    )
    assert sorted(p.name for p in small_disk.iterdir()) == sorted([first.name, "filler"]), "nothing half-written"
    assert torch.equal(load_checkpoint(str(first))["model"]["w"], state["model"]["w"])


def test_a_sharded_checkpoint_is_read_whole_with_no_room_in_tmpdir(small_disk, tmp_path, monkeypatch):
    """Evaluation, MODEL.WEIGHTS and the converter read a .dcp whole into memory: a full TMPDIR
    (a cluster node's small /tmp) does not stop them, and nothing is written there."""
    state = {"model": {"w": torch.arange(64 << 10, dtype=torch.float32)}, "epoch": 3}  # 256 KiB
    save_states_of(state, str(tmp_path / "ckpt.dcp"))
    _fill(small_disk, leave=0)
    monkeypatch.setenv("TMPDIR", str(small_disk))
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))
    read = load_checkpoint(str(tmp_path / "ckpt.dcp"))
    assert torch.equal(read["model"]["w"], state["model"]["w"]) and read["epoch"] == 3
    assert [p.name for p in small_disk.iterdir()] == ["filler"]


def save_states_of(state: dict, path: str) -> None:
    """Write ``state``'s model dict as a one-rank sharded (DCP) checkpoint."""
    save_states(path, {"model": PlainState(state["model"])}, {"epoch": state["epoch"]})
