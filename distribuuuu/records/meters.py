"""Metrics: top-k counts and exact, sample-weighted sums reduced across ranks only when asked."""

from __future__ import annotations

import torch

from distribuuuu.runtime.process_group import all_reduce_sum, get_rank


class AverageMeter:
    """Running average of a scalar (kept for scripts written against Distribuuuu's API)."""

    def __init__(self, name: str = "", fmt: str = ":f"):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self) -> None:
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


@torch.no_grad()
def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...]) -> list[torch.Tensor]:
    """Number of samples whose target is among the top-k logits, for each k (no host sync); with
    multi-hot targets (MODEL.TASK multilabel), whose top-k logits hold one of its classes."""
    pred = logits.topk(max(ks), dim=1).indices
    hits = target.gather(1, pred) > 0 if target.dim() == 2 else pred.eq(target.view(-1, 1))
    return [hits[:, :k].any(dim=1).sum() for k in ks]


@torch.no_grad()
def accuracy(logits: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[torch.Tensor]:
    """Top-k accuracy in percent of this batch, for each k (Distribuuuu's helper)."""
    return [c.float() * (100.0 / target.size(0)) for c in topk_correct(logits, target, topk)]


class MetricSums:
    """Sums of loss x samples, top-1 and top-k hits and samples, kept on the device.

    Adding a batch costs no host sync; ``reduce`` sums over ranks (one all-reduce) and is called
    only at PRINT_FREQ and at the end of an epoch. Means derived from these sums are exact for
    any world size, unlike a mean of per-rank means. Batches with a non-finite loss are counted
    in ``nonfinite`` and left out of the loss mean.

    With ``ranks`` W > 0 the same tensor carries W slots per per-rank field (``RANK_FIELDS``): each
    rank writes its own slot and leaves the others 0, so the all-reduce's sum is the gather of every
    rank's value, in the collective that runs anyway.
    """

    FIELDS = (
        "loss_sum", "loss_samples", "top1", "topk", "samples", "nonfinite",
        "skipped_images", "skipped_steps", "stop", "interrupt",
    )  # fmt: skip

    RANK_FIELDS = ("rank_step_s", "rank_data_s")  # each rank's seconds a step, and waiting for data a step

    def __init__(self, device: torch.device, k: int, ranks: int = 0):
        self.k, self.ranks = k, ranks
        self.sums = torch.zeros(len(self.FIELDS) + ranks * len(self.RANK_FIELDS), dtype=torch.float64, device=device)
        self._counts_once = get_rank() == 0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Accumulate a batch: ``loss`` is its mean loss, ``target`` its hard labels."""
        n = target.size(0)
        loss = loss.detach()
        top1, topk = topk_correct(logits, target, (1, self.k))
        finite = torch.isfinite(loss)
        update = [torch.where(finite, loss * n, 0.0), finite * n, top1, topk, top1.new_full((), n), ~finite]
        self.sums[:6] += torch.stack([t.double() for t in update])

    def add_field(self, field: str, value: float | torch.Tensor) -> None:
        """Add to one field (skipped images, or the stop flag that is summed over ranks)."""
        self.sums[self.FIELDS.index(field)] += value

    def add_once(self, field: str, value: float | torch.Tensor) -> None:
        """Add an event that every rank sees alike (a skipped optimizer step): counted on rank 0 only,
        so the sum over ranks counts it once, whatever the world size."""
        if self._counts_once:
            self.add_field(field, value)

    def set_rank_values(self, rank: int, values: dict[str, float]) -> None:
        """Write this rank's slot of each per-rank field (``RANK_FIELDS``); the others stay 0 until ``reduce``."""
        for i, field in enumerate(self.RANK_FIELDS):
            self.sums[len(self.FIELDS) + i * self.ranks + rank] = values[field]

    def reduce(self) -> dict[str, float]:
        """Sum over ranks (one all-reduce, one host sync); return the totals, the means and, with per-rank
        slots, each per-rank field as a list in rank order."""
        return self._with_means(all_reduce_sum(self.sums.clone()))

    def add_totals(self, totals: dict[str, float]) -> None:
        """Add totals that ``reduce`` returned (already summed over ranks): an epoch's windows."""
        added = torch.tensor([totals[f] for f in self.FIELDS], dtype=self.sums.dtype, device=self.sums.device)
        self.sums[: len(self.FIELDS)] += added

    def totals(self) -> dict[str, float]:
        """The totals and means of this process's sums, with no reduction (after ``add_totals``)."""
        return self._with_means(self.sums)

    def _with_means(self, sums: torch.Tensor) -> dict[str, float]:
        values = sums.tolist()
        totals = dict(zip(self.FIELDS, values))
        slots = values[len(self.FIELDS) :]
        for i, field in enumerate(self.RANK_FIELDS if self.ranks else ()):
            totals[field] = slots[i * self.ranks : (i + 1) * self.ranks]
        n = max(totals["samples"], 1.0)
        totals["loss"] = totals["loss_sum"] / max(totals["loss_samples"], 1.0)
        totals["top1_acc"] = 100.0 * totals["top1"] / n
        totals["topk_acc"] = 100.0 * totals["topk"] / n
        return totals

    def reset(self) -> None:
        self.sums.zero_()
