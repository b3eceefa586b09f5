"""Confusion matrix and per-class accuracy: a 2-process gloo job against one process's count."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_ok, run, torchrun

from distribuuuu.records.eval_outputs import ConfusionMatrix, confusion_png, per_class_accuracy, save_evaluation

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import confusion_job  # noqa: E402


def _count_by_hand(logits: torch.Tensor, targets: torch.Tensor, num_classes: int) -> list[list[int]]:
    """One process over every sample: matrix[target][argmax] += 1."""
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for row, target in zip(logits.tolist(), targets.tolist()):
        matrix[target][row.index(max(row))] += 1
    return matrix


@pytest.mark.slow
def test_two_ranks_reduce_to_the_single_process_matrix(tmp_path):
    result = run(torchrun(2, str(REPO / "tests" / "scripts" / "confusion_job.py"), str(tmp_path)), timeout=180)
    assert_ok(result)
    locals_ = sorted(int(line.split("local=")[1]) for line in result.stdout.splitlines() if line.startswith("OK"))
    assert locals_ == [26, 27]  # each rank counted only its shard
    logits, targets = confusion_job.dataset()
    expected = _count_by_hand(logits, targets, confusion_job.NUM_CLASSES)
    saved = json.loads((tmp_path / "val_per_class.json").read_text())
    assert saved["confusion"] == expected
    with open(tmp_path / "val_confusion.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["target\\predicted", "class_0", "class_1", "class_2", "class_3"]
    assert [[int(v) for v in row[1:]] for row in rows[1:]] == expected
    for c, name in enumerate(rows[0][1:]):
        entry = saved["classes"][name]
        assert (entry["samples"], entry["correct"]) == (sum(expected[c]), expected[c][c])
        assert entry["accuracy"] == pytest.approx(100.0 * expected[c][c] / sum(expected[c]))
    assert (tmp_path / "val_confusion.png").read_bytes().startswith(b"\x89PNG")


def test_per_class_accuracy_is_the_diagonal_over_row_sums_and_nan_without_samples(tmp_path):
    matrix = ConfusionMatrix(3)
    matrix.update(torch.tensor([0, 1, 1, 0, 2]), torch.tensor([0, 1, 0, 0, 1]))  # predictions, targets
    reduced = matrix.reduce()  # no process group: this process's counts
    assert reduced.tolist() == [[2, 1, 0], [0, 1, 1], [0, 0, 0]]
    accuracy = per_class_accuracy(reduced)
    assert accuracy[:2].tolist() == pytest.approx([200 / 3, 50.0]) and accuracy[2].isnan()
    save_evaluation(tmp_path, "test", reduced, ["a", "b", "c"])
    assert json.loads((tmp_path / "test_per_class.json").read_text())["classes"]["c"] == {
        "samples": 0,
        "correct": 0,
        "accuracy": None,
    }


def test_counting_matches_a_double_loop_without_bincount(monkeypatch):
    # CUDA's bincount reads its input's min and max on the host: two syncs per evaluation batch.
    # On the CPU, the stand-in for torch.cuda.set_sync_debug_mode is that bincount is never called.
    def no_bincount(*args, **kwargs):
        raise AssertionError("torch.bincount syncs the host on CUDA")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    generator = torch.Generator().manual_seed(0)
    num_classes, matrix = 7, ConfusionMatrix(7)
    batches = [
        (torch.randn(n, num_classes, generator=generator), torch.randint(0, num_classes, (n,), generator=generator))
        for n in (1, 33, 64)
    ]
    for logits, targets in batches:
        matrix.update(logits, targets)
    logits, targets = (torch.cat(parts) for parts in zip(*batches))
    assert matrix.reduce().tolist() == _count_by_hand(logits, targets, num_classes)


def test_without_matplotlib_the_picture_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with caplog.at_level(logging.WARNING, logger="distribuuuu.records.eval_outputs"):
        assert confusion_png(torch.eye(2, dtype=torch.int64), ["a", "b"]) is None
        written = save_evaluation(tmp_path, "val", torch.eye(2, dtype=torch.int64), ["a", "b"])
    assert [Path(p).name for p in written] == ["val_confusion.csv", "val_per_class.json"]
    assert "matplotlib is not installed" in caplog.text
