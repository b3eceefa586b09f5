"""Where a training window's time went, from host values its one all-reduce already gathered: the data
wait's share of a step, every rank's step time (min, median, max) and the slowest rank, a straggler
named in one warning with its host, and the model's achieved TFLOP/s and MFU against a peak.

Takes numbers, not a run: the trainer hands it the reduced totals (their per-rank slots:
``records/meters.py``) and the rank -> host table of the start-up check. No collective, no device.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from distribuuuu.logger import SAME_ON_EVERY_RANK, get_logger

logger = get_logger("trainer")
# A training record's telemetry fields (``Telemetry.end_epoch``), what metrics.jsonl keeps of them
EPOCH_FIELDS = (
    "data_share", "step_s_min", "step_s_median", "step_s_max", "slowest_rank", "rank_step_s", "straggler_windows",
    "flops_per_image", "tflops", "mfu",
)  # fmt: skip


@dataclass(frozen=True)
class WindowTelemetry:
    """One window's timing over the ranks, and its model FLOP rate (None where FLOPs are not known)."""

    data_share: float  # seconds waiting for data over seconds of step, all ranks together
    step_min: float
    step_median: float
    step_max: float
    slowest: int  # the rank furthest behind the others (``straggler_score``)
    tflops: float | None = None  # achieved model TFLOP/s per device
    mfu: float | None = None  # tflops over the device's peak (LOG.PEAK_TFLOPS)

    def text(self) -> str:
        """The log line's part after the data wait: ' (3%)  step 0.41/0.42/0.47s slowest rank 1  5.1 TFLOP/s
        mfu 40.3%': the data share of all ranks' steps, the step time's min/median/max over the ranks."""
        line = f" ({100 * self.data_share:.0f}%)  step {self.step_min:.3g}/{self.step_median:.3g}/{self.step_max:.3g}s"
        line += f" slowest rank {self.slowest}" + (f"  {self.tflops:.3g} TFLOP/s" if self.tflops is not None else "")
        return line + (f"  mfu {100 * self.mfu:.1f}%" if self.mfu is not None else "")

    def curves(self) -> dict[str, float]:
        """The window's values for TensorBoard and the trackers."""
        values = {"data_share": self.data_share, "step_s_min": self.step_min, "step_s_median": self.step_median}
        values |= {"step_s_max": self.step_max}
        return values | {k: v for k, v in (("tflops", self.tflops), ("mfu", self.mfu)) if v is not None}


def straggler_score(step_s: list[float], data_s: list[float], rank: int) -> float:
    """How far behind the other ranks ``rank`` is, in their median step: its step time over theirs, or
    1 + its extra data wait over their step. The second matters because every step's gradient
    all-reduce makes the others wait for a rank that is late with its batch: their step times grow as
    much as its own, and its data wait alone tells which rank they waited for."""
    others = [i for i in range(len(step_s)) if i != rank]
    if not others:
        return 1.0
    median_step = statistics.median(step_s[i] for i in others)
    median_data = statistics.median(data_s[i] for i in others)
    if median_step <= 0:
        return 1.0
    return max(step_s[rank] / median_step, 1.0 + (data_s[rank] - median_data) / median_step)


class Telemetry:
    """A run's timing records: each window's ``WindowTelemetry`` (and straggler warning), summed into
    the epoch's training record. ``flops_per_image``: model FLOPs of one training image (0: unknown),
    or ``flops_by_size``'s at the size ``at_size`` names (progressive resizing);
    ``peak_tflops``: one device's peak (0: no MFU); ``straggler_factor``: warn when a rank is this
    many median steps behind (0: never)."""

    def __init__(
        self, flops_per_image: float = 0.0, peak_tflops: float = 0.0, straggler_factor: float = 0.0,
        flops_by_size: dict[int, float] | None = None,
    ):  # fmt: skip
        self.flops_per_image, self.peak_tflops, self.straggler_factor = flops_per_image, peak_tflops, straggler_factor
        self.flops_by_size = dict(flops_by_size or {})  # image size -> FLOPs of a training image at it
        self._reset()

    def at_size(self, image_size: int) -> None:
        """The epoch trains at ``image_size`` (progressive resizing): its FLOPs a training image, where counted."""
        self.flops_per_image = self.flops_by_size.get(image_size, self.flops_per_image)

    def _reset(self) -> None:
        self.rank_step_s: list[float] = []  # seconds of step per rank over the epoch's windows
        self.rank_data_s: list[float] = []
        self.steps, self.samples, self.seconds, self.stragglers = 0, 0.0, 0.0, 0

    def window(self, totals: dict, elapsed_s: float, steps: int, where: str, hosts: list[str]) -> WindowTelemetry:
        """The window's telemetry from the reduced ``totals`` (its per-rank slots) and rank 0's ``elapsed_s``
        over ``steps`` steps; warn, naming rank and host, when a rank is LOG.STRAGGLER_FACTOR behind."""
        step_s, data_s = totals["rank_step_s"], totals["rank_data_s"]
        self._accumulate(step_s, data_s, steps, totals["samples"], elapsed_s)
        scores = [straggler_score(step_s, data_s, r) for r in range(len(step_s))]
        slowest = max(range(len(scores)), key=scores.__getitem__)
        tflops = self._tflops(totals["samples"] / max(elapsed_s, 1e-9), len(step_s))
        if self.straggler_factor and scores[slowest] > self.straggler_factor:
            self._warn_straggler(step_s, data_s, scores[slowest], slowest, where, hosts)
        return WindowTelemetry(
            sum(data_s) / max(sum(step_s), 1e-12), min(step_s), statistics.median(step_s), max(step_s), slowest,
            tflops, tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None,
        )  # fmt: skip

    def _accumulate(self, step_s: list, data_s: list, steps: int, samples: float, elapsed_s: float) -> None:
        if not self.rank_step_s:
            self.rank_step_s, self.rank_data_s = [0.0] * len(step_s), [0.0] * len(step_s)
        for r in range(len(step_s)):
            self.rank_step_s[r] += step_s[r] * steps
            self.rank_data_s[r] += data_s[r] * steps
        self.steps, self.samples, self.seconds = self.steps + steps, self.samples + samples, self.seconds + elapsed_s

    def _tflops(self, images_per_s: float, world_size: int) -> float | None:
        """Achieved model TFLOP/s of one device: FLOPs per training image x images/s over the ranks."""
        return self.flops_per_image * images_per_s / world_size / 1e12 if self.flops_per_image else None

    def _warn_straggler(self, step_s: list, data_s: list, score: float, rank: int, where: str, hosts: list) -> None:
        self.stragglers += 1
        others = [r for r in range(len(step_s)) if r != rank]
        logger.warning(
            "straggler at %s: rank %d on %s is %.2f median steps behind (step %.3gs, data wait %.3gs a step; "
            "the others' median: %.3gs, %.3gs) > LOG.STRAGGLER_FACTOR %g",
            where, rank, hosts[rank] if rank < len(hosts) else "?", score, step_s[rank], data_s[rank],
            statistics.median(step_s[r] for r in others), statistics.median(data_s[r] for r in others),
            self.straggler_factor, extra=SAME_ON_EVERY_RANK,  # reduced values: rank 0 says it once
        )  # fmt: skip

    def end_epoch(self) -> dict:
        """The epoch's fields for its training record (every rank's mean step and the same summaries as a
        window's, over the epoch's windows); the counts start again."""
        if not self.steps:
            return {}
        step = [s / self.steps for s in self.rank_step_s]
        fields = {
            "data_share": sum(self.rank_data_s) / max(sum(self.rank_step_s), 1e-12),
            "step_s_min": min(step), "step_s_median": statistics.median(step), "step_s_max": max(step),
            "slowest_rank": max(range(len(step)), key=step.__getitem__), "rank_step_s": step,
            "straggler_windows": self.stragglers,
        }  # fmt: skip
        tflops = self._tflops(self.samples / max(self.seconds, 1e-9), len(step))
        if tflops is not None:
            fields |= {"flops_per_image": self.flops_per_image, "tflops": tflops}
            fields |= {"mfu": tflops / self.peak_tflops} if self.peak_tflops else {}
        self._reset()
        return fields
