"""The defaults keep a small run small: the quick start's OUT_DIR (resnet18 on the digits, 10 epochs)
under 150 MB, measured on a shortened run of the same model, optimizer and checkpoint policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import DUMMY_OPTS, TRAIN, assert_ok, in_process

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing import formats
from distribuuuu.checkpointing.formats import Component, SingleFile
from distribuuuu.checkpointing.manager import Checkpointer
from distribuuuu.config import get_cfg_defaults
from distribuuuu.errors import CheckpointError

QUICK_START_LIMIT = 150e6  # bytes: what the README promises for the first command's OUT_DIR
EPOCHS = 3  # enough to prune: every epoch writes a checkpoint


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_quick_starts_out_dir_stays_under_150_mb_and_keeps_what_a_resume_needs(tmp_path):
    """The default model and optimizer on synthetic images (checkpoint sizes do not depend on the
    data) with the default checkpoint policy; the 7 more epochs of the quick start add a few KB of
    records (log lines, metrics.jsonl, TensorBoard events)."""
    assert get_cfg_defaults().MODEL.ARCH == "resnet18"
    out = tmp_path / "out"
    opts = [*DUMMY_OPTS, "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "OPTIM.MAX_EPOCH", str(EPOCHS)]
    assert_ok(in_process(TRAIN, "OUT_DIR", str(out), *opts))
    kept = [Path(p) for p in ckpt.list_checkpoints(str(out / ckpt.CKPT_DIR))]
    assert [p.name for p in kept] == [ckpt.checkpoint_name(EPOCHS)], "the newest checkpoint: what a resume takes"
    last = ckpt.load_checkpoint(str(kept[0]))
    params = sum(t.numel() * t.element_size() for k, t in last["model"].items() if "running" not in k)
    assert kept[0].stat().st_size > 1.9 * params, "weights and SGD's momentum: all a resume needs"
    best = out / ckpt.BEST_NAME
    assert "optimizer" not in ckpt.load_checkpoint(str(best))
    total = folder_bytes(out)
    assert total - kept[0].stat().st_size - best.stat().st_size < 1e6, "the rest: records, a few KB an epoch"
    assert total < QUICK_START_LIMIT, f"{total / 1e6:.1f} MB"


class Weights(Component):
    """A model's weights as a checkpoint component."""

    def __init__(self, value: float):
        self.weights = {"w": torch.full((1024,), value)}

    def state_dict(self) -> dict:
        return {"model": self.weights}

    def load_state_dict(self, state_dict: dict) -> None:
        self.weights = state_dict["model"]


def test_keeping_one_checkpoint_removes_the_previous_only_once_the_new_one_reads_back(tmp_path, monkeypatch):
    checkpoints = Checkpointer(str(tmp_path), SingleFile(), keep=1)
    first = checkpoints.save({"model": Weights(1.0)}, 1, 0, False, False)
    second = checkpoints.save({"model": Weights(2.0)}, 2, 0, False, False)
    assert [Path(p).name for p in ckpt.list_checkpoints(checkpoints.ckpt_dir)] == [Path(second).name]
    assert not Path(first).exists()

    real_write = formats.write_files

    def torn_on_disk(state, path, best, best_path):  # the bytes on disk are not what was checksummed
        real_write(state, path, best, best_path)
        Path(path).write_bytes(Path(path).read_bytes()[:-100])

    monkeypatch.setattr(formats, "write_files", torn_on_disk)
    with pytest.raises(CheckpointError, match="ckpt_ep_003"):
        checkpoints.save({"model": Weights(3.0)}, 3, 0, False, False)
    monkeypatch.undo()
    assert Path(second).is_file(), "the previous checkpoint stays: the one a resume can take"
    path, _ = checkpoints.find_resumable()
    assert path == second and torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.full((1024,), 2.0))
