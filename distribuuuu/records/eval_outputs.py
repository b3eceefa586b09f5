"""Evaluation output beyond top-k: a confusion matrix summed over ranks, per-class accuracy, files and a picture."""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path

import torch

from distribuuuu.files import write_bytes
from distribuuuu.records.plots import PLOT_INSTALL
from distribuuuu.runtime.process_group import all_gather_object, all_reduce_sum, is_main_process

logger = logging.getLogger(__name__)


class ConfusionMatrix:
    """Counts of (target, prediction) pairs, kept on the device: adding a batch costs no host sync.

    Rows are targets, columns predictions. ``reduce`` sums over ranks with one all-reduce, so with
    ExactEvalSampler (every sample on exactly one rank) the matrix is that of one process over the
    whole set, for any world size.
    """

    def __init__(self, num_classes: int, device: torch.device | str = "cpu"):
        self.num_classes = num_classes
        self.counts = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Count a batch: ``logits`` (N, C), or predicted classes (N,); ``target`` hard labels (N,)."""
        pred = logits.argmax(dim=1) if logits.ndim == 2 else logits
        cells = target.long() * self.num_classes + pred.long()
        # index_add_, not bincount: CUDA's bincount reads its input's min and max on the host (two
        # syncs per batch); index_add_ of integer ones stays on the device and is exact in any order.
        self.counts.index_add_(0, cells, torch.ones_like(cells))

    def reduce(self) -> torch.Tensor:
        """Return the (C, C) matrix summed over ranks, on the CPU (a collective: every rank calls it)."""
        return all_reduce_sum(self.counts.clone()).view(self.num_classes, self.num_classes).cpu()

    def reset(self) -> None:
        self.counts.zero_()


class Predictions:
    """Each evaluated sample's top-k classes, kept on the device until the end of the evaluation.

    ``gather`` pairs them with the dataset indices this rank's sampler yielded, in order, and
    collects every rank's on the main process: with ExactEvalSampler each sample appears once,
    whatever the world size. A batch that dropped unreadable images breaks that pairing, so then
    nothing is saved (with a warning).
    """

    def __init__(self, k: int):
        self.k, self.topk, self.targets, self.dropped = k, [], [], 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, dropped: int = 0) -> None:
        self.topk.append(logits.topk(self.k, dim=1).indices)
        self.targets.append(target)
        self.dropped += dropped

    def gather(self, indices: list[int]) -> list[tuple[int, int, list[int]]] | None:
        """``(index, target, top-k)`` of every sample of every rank, by index, on the main process
        (None elsewhere, or after dropped images); a collective: every rank calls it."""
        mine = None
        if not self.dropped:
            topk = torch.cat(self.topk).tolist() if self.topk else []
            targets = torch.cat(self.targets).tolist() if self.targets else []
            mine = list(zip(indices, targets, topk))
        gathered = all_gather_object(mine)
        if any(rows is None for rows in gathered):
            logger.warning("predictions not saved: unreadable images were skipped (DATA.BAD_IMAGE skip)")
            return None
        return sorted(row for rows in gathered for row in rows) if is_main_process() else None


class EvalOutputs:
    """What one evaluation saves beyond its metrics: the confusion matrix and/or the predictions.

    Per batch everything stays on the device; ``save`` costs one all-reduce (the matrix) and one
    gather (the predictions) per evaluation, and only the main process writes.
    """

    def __init__(self, num_classes: int, k: int, device: torch.device, confusion: bool, predictions: bool):
        self.confusion = ConfusionMatrix(num_classes, device) if confusion else None
        self.predictions = Predictions(k) if predictions else None

    def update(self, logits: torch.Tensor, target: torch.Tensor, dropped: int = 0) -> None:
        if self.confusion is not None:
            self.confusion.update(logits, target)
        if self.predictions is not None:
            self.predictions.update(logits, target, dropped)

    def save(self, out_dir: str | Path, prefix: str, indices: list[int], paths: list[str], names: list[str]) -> None:
        """Reduce and write ``<prefix>_*`` files under ``out_dir`` (a collective: every rank calls it)."""
        if self.confusion is not None:
            save_evaluation(out_dir, prefix, self.confusion.reduce(), names)
        if self.predictions is not None:
            save_predictions(out_dir, prefix, self.predictions.gather(indices), paths, names)


def save_predictions(
    out_dir: str | Path, prefix: str, rows: list[tuple[int, int, list[int]]], paths: list[str], class_names: list[str]
) -> Path | None:
    """Write ``<prefix>_predictions.csv``: index, path, target and top-k class names (main process only)."""
    if not is_main_process() or rows is None:
        return None
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    k = len(rows[0][2]) if rows else 0
    writer.writerow(["index", "path", "target", *(f"top{i + 1}" for i in range(k))])
    for index, target, topk in rows:
        path = paths[index] if index < len(paths) else ""
        writer.writerow([index, path, class_names[target], *(class_names[c] for c in topk)])
    return _write(Path(out_dir) / f"{prefix}_predictions.csv", out.getvalue().encode())


def per_class_accuracy(matrix: torch.Tensor) -> torch.Tensor:
    """Recall of each class in percent: the diagonal over the row sums (NaN for a class without samples)."""
    samples = matrix.sum(dim=1).double()
    return 100.0 * matrix.diagonal().double() / samples  # 0 / 0 is NaN: no sample, no accuracy


def confusion_csv(matrix: torch.Tensor, class_names: list[str]) -> str:
    """The matrix as CSV: a header of predicted class names, one row per target class."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["target\\predicted", *class_names])
    for name, row in zip(class_names, matrix.tolist()):
        writer.writerow([name, *row])
    return out.getvalue()


def per_class_json(matrix: torch.Tensor, class_names: list[str]) -> str:
    """Samples, correct predictions and accuracy per class, and the matrix itself, as JSON."""
    accuracy = per_class_accuracy(matrix).tolist()
    classes = {
        name: {"samples": int(row.sum()), "correct": int(row[i]), "accuracy": None if acc != acc else acc}
        for i, (name, row, acc) in enumerate(zip(class_names, matrix, accuracy))
    }  # NaN is not JSON: a class without samples has accuracy null
    return json.dumps({"classes": classes, "confusion": matrix.tolist()}, indent=1)


def save_evaluation(out_dir: str | Path, prefix: str, matrix: torch.Tensor, class_names: list[str]) -> list[Path]:
    """Write ``<prefix>_confusion.csv``, ``<prefix>_per_class.json`` and, with matplotlib, ``<prefix>_confusion.png``.

    Only the main process writes (other ranks return ``[]``); each file is replaced atomically.
    """
    if not is_main_process():
        return []
    out_dir = Path(out_dir)
    written = [
        _write(out_dir / f"{prefix}_confusion.csv", confusion_csv(matrix, class_names).encode()),
        _write(out_dir / f"{prefix}_per_class.json", per_class_json(matrix, class_names).encode()),
    ]
    png = confusion_png(matrix, class_names)
    if png is not None:
        written.append(_write(out_dir / f"{prefix}_confusion.png", png))
    return written


def confusion_png(matrix: torch.Tensor, class_names: list[str]) -> bytes | None:
    """Draw the row-normalised matrix as a PNG; None, with a warning, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (%s): no confusion-matrix picture", PLOT_INSTALL)
        return None
    rows = matrix.double() / matrix.sum(dim=1, keepdim=True).clamp(min=1)
    size = min(4 + 0.25 * len(class_names), 40)
    fig, ax = plt.subplots(figsize=(size, size))
    image = ax.imshow(rows.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, label="fraction of the target class")
    if len(class_names) <= 50:  # beyond that the labels overlap into a black band
        ticks = range(len(class_names))
        ax.set_xticks(ticks, class_names, rotation=90)
        ax.set_yticks(ticks, class_names)
    ax.set(xlabel="predicted", ylabel="target", title="confusion matrix (rows sum to 1)")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _write(path: Path, data: bytes) -> Path:
    write_bytes(str(path), data)  # atomic: a reader never sees half a file
    return path
