"""Confusion matrix and per-class accuracy: every rank of a threaded process group against one
process's count."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import on_ranks

from distribuuuu.data.samplers import ExactEvalSampler
from distribuuuu.records.eval_outputs import ConfusionMatrix, confusion_png, per_class_accuracy, save_evaluation

NUM_SAMPLES, NUM_CLASSES = 53, 4  # 53: divisible by neither 2 nor 3


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets of the whole evaluation set, the same on every rank and in the check."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(NUM_SAMPLES, NUM_CLASSES, generator=g), torch.randint(
        0, NUM_CLASSES, (NUM_SAMPLES,), generator=g
    )


def _count_by_hand(logits: torch.Tensor, targets: torch.Tensor, num_classes: int) -> list[list[int]]:
    """One process over every sample: matrix[target][argmax] += 1."""
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for row, target in zip(logits.tolist(), targets.tolist()):
        matrix[target][row.index(max(row))] += 1
    return matrix


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_reduce_to_the_single_process_matrix_and_only_rank_0_writes(tmp_path, world):
    # Each rank counts its ExactEvalSampler shard in batches of 5 (the last shorter) and calls the
    # collective reduce; rank 0 alone writes the files.
    logits, targets = _dataset()
    names = [f"class_{c}" for c in range(NUM_CLASSES)]

    def rank_job(rank: int) -> tuple[list[int], list[list[int]], list[list[int]], list]:
        shard = list(ExactEvalSampler(NUM_SAMPLES, world, rank))
        matrix = ConfusionMatrix(NUM_CLASSES)
        for batch in torch.tensor(shard).split(5):
            matrix.update(logits[batch], targets[batch])
        local = matrix.counts.view(NUM_CLASSES, NUM_CLASSES).tolist()
        reduced = matrix.reduce()
        return shard, local, reduced.tolist(), save_evaluation(tmp_path, "val", reduced, names)

    ranks = on_ranks(world, rank_job)
    shards = [shard for shard, *_ in ranks]
    assert sorted(i for shard in shards for i in shard) == list(range(NUM_SAMPLES))  # each sample on one rank
    assert sorted(len(s) for s in shards) == sorted(
        NUM_SAMPLES // world + (r < NUM_SAMPLES % world) for r in range(world)
    )
    expected = _count_by_hand(logits, targets, NUM_CLASSES)
    for shard, local, reduced, _ in ranks:
        assert local == _count_by_hand(logits[shard], targets[shard], NUM_CLASSES)  # each rank counted its shard only
        assert reduced == expected
    assert [bool(written) for *_, written in ranks] == [True] + [False] * (world - 1)  # only the main process writes
    saved = json.loads((tmp_path / "val_per_class.json").read_text())
    assert saved["confusion"] == expected
    with open(tmp_path / "val_confusion.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["target\\predicted", *names]
    assert [[int(v) for v in row[1:]] for row in rows[1:]] == expected
    for c, name in enumerate(names):
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
