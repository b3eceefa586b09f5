"""The metrics plot of distribuuuu runs: loss, top-1 (a multi-label run's val mAP and F1 macro), LR
and images/s per epoch, the best evaluation marked (needs matplotlib).

Used by tools/plot_metrics.py (any runs) and by the end-of-training summary (summary.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distribuuuu.records.metrics_file import METRICS_FILE, Record, read_records

# How to get matplotlib: the "plot" extra, as the README installs it (every message says the same).
PLOT_INSTALL = 'pip install -e ".[plot]"'


@dataclass
class RecordedRun:
    """The de-duplicated records of one run, keyed by (split, weights), sorted by epoch."""

    label: str
    series: dict[tuple[str, str], list[Record]] = field(default_factory=dict)

    def get(self, split: str, weights: str = "model") -> list[Record]:
        return self.series.get((split, weights), [])


# A metric's name in the plot and the summary, and whether it is a percentage.
METRIC_NAMES = {"top1": "top-1", "map": "mAP", "f1_macro": "F1 macro", "loss": "loss"}
PERCENT = {"top1", "map", "f1_macro"}
# The metrics a run is judged by: mAP and F1 macro where its evaluations have them (MODEL.TASK
# multilabel, whose top-1 is precision at 1), top-1 otherwise.
MULTILABEL_HEADLINE, HEADLINE = ("map", "f1_macro"), ("top1",)


def headline(record: Record) -> tuple[str, ...]:
    """The metrics an evaluation record is judged by."""
    return MULTILABEL_HEADLINE if "map" in record else HEADLINE


def best_record(val_records: list[Record]) -> Record:
    """The val record the run chose as its best: the last one written marked ``best`` (by
    TRAIN.BEST_METRIC, as the trainer's ``Best`` decided); in a run recorded before records were
    marked, the best top-1."""
    marked = [r for r in val_records if r.get("best")]
    if marked:
        return marked[-1]
    return max((r for r in val_records if "top1" in r), key=lambda r: r["top1"], default={})


def dedupe(records: list[Record]) -> dict[tuple[str, str], list[Record]]:
    """Keep the last record per (epoch, split, weights); group by (split, weights)."""
    last: dict[tuple[int, str, str], Record] = {}
    for r in records:
        if not isinstance(r.get("epoch"), (int, float)) or "split" not in r:
            continue
        last[(int(r["epoch"]), str(r["split"]), str(r.get("weights", "model")))] = r
    series: dict[tuple[str, str], list[Record]] = {}
    for (_, split, weights), r in sorted(last.items()):
        series.setdefault((split, weights), []).append(r)
    return series


def load_run(out_dir: str, label: str | None, records: list[Record] | None = None) -> RecordedRun:
    """OUT_DIR's run for the plot: its ``records`` if already read, else its metrics.jsonl's."""
    records = read_records(os.path.join(out_dir, METRICS_FILE)) if records is None else records
    name = label or os.path.basename(os.path.normpath(os.path.abspath(out_dir)))
    return RecordedRun(label=name, series=dedupe(records))


def xy(records: list[Record], key: str) -> tuple[list[float], list[float]]:
    """Epochs and values of `key`, skipping records without a numeric value."""
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(float(r["epoch"]))
            ys.append(float(value) if math.isfinite(value) else math.nan)
    return xs, ys


def plot_series(ax: Any, records: list[Record], key: str, style: dict[str, Any]) -> None:
    xs, ys = xy(records, key)
    if xs:
        one_point = {"marker": "o", "markersize": 4} if len(xs) == 1 else {}  # a line through one point is not drawn
        ax.plot(xs, ys, **{**one_point, **style})


def draw_run(axes: Any, run: RecordedRun, color: str) -> None:
    """Draw one run's curves on the four axes (loss, top-1 or mAP and F1, lr, images/s) and mark
    its best evaluation."""
    train, val, ema = run.get("train"), run.get("val"), run.get("val", "ema")
    thin = {"color": color, "linewidth": 1.2, "alpha": 0.75}
    dots = {"color": color, "linewidth": 1.8, "marker": "o", "markersize": 3}
    dashed = {**dots, "linestyle": "--", "marker": "s"}
    ax_loss, ax_metric, ax_lr, ax_ips = axes
    plot_series(ax_loss, train, "loss", {**thin, "label": f"{run.label} train"})
    plot_series(ax_loss, val, "loss", {**dots, "label": f"{run.label} val"})
    fields = headline(val[0] if val else {})
    if fields == HEADLINE:  # a multi-label run's training top-1 is precision at 1: not drawn
        plot_series(ax_metric, train, "top1", {**thin, "label": f"{run.label} train"})
    for key, marker in zip(fields, ("o", "^")):
        name = "" if key == "top1" else f" {METRIC_NAMES[key]}"  # one metric: the title names it
        plot_series(ax_metric, val, key, {**dots, "marker": marker, "label": f"{run.label} val{name}"})
        plot_series(ax_metric, ema, key, {**dashed, "marker": marker, "label": f"{run.label} val (ema){name}"})
    plot_series(ax_lr, train, "lr", {**thin, "alpha": 1.0, "label": run.label})
    plot_series(ax_ips, train, "images_per_s", {**dots, "label": run.label})
    # In the order written: an epoch's EMA evaluation follows its raw one, and the last marked wins
    mark_best(ax_loss, ax_metric, sorted(val + ema, key=lambda r: float(r["epoch"])), color, run.label)


def mark_best(ax_loss: Any, ax_metric: Any, val_records: list[Record], color: str, label: str) -> None:
    """A star at the evaluation the run marked as its best, on the axis of the metric that chose it."""
    best = best_record([r for r in val_records if r.get("best")])  # an unmarked run chose by nothing recorded
    metric = best.get("best")
    if metric not in METRIC_NAMES or not isinstance(best.get(metric), (int, float)):
        return
    ax = ax_loss if metric == "loss" else ax_metric
    what = f"{METRIC_NAMES[metric]}, {best.get('weights', 'model')} weights"
    style = {"color": color, "marker": "*", "markersize": 12, "linestyle": "none"}
    ax.plot([float(best["epoch"])], [float(best[metric])], **style, label=f"{label} best ({what})")


def metric_title(runs: Sequence[RecordedRun]) -> str:
    """The second axis's title: what the runs are judged by."""
    kinds = {headline(run.get("val")[0]) if run.get("val") else HEADLINE for run in runs}
    names = ["top-1 accuracy" if kind == HEADLINE else "val mAP and F1 macro" for kind in sorted(kinds)]
    return "; ".join(names) + " (%)"


def style_axes(axes: Any, metric: str) -> None:
    from matplotlib.ticker import MaxNLocator

    titles = ("loss (log scale)", metric, "learning rate", "training throughput (images/s)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole epochs: no tick at 1.25
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    # Losses span decades (an early val loss is often 100x the final one): a log axis shows them all.
    if all(y > 0 for line in axes[0].get_lines() for y in line.get_ydata()):
        axes[0].set_yscale("log")
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def make_figure(plt: Any, runs: Sequence[RecordedRun]) -> Any:
    fig, grid = plt.subplots(2, 2, figsize=(12, 8.5))
    axes = grid.flatten()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        draw_run(axes, run, colors[i % len(colors)])
    style_axes(axes, metric_title(runs))
    fig.suptitle("distribuuuu metrics: " + ", ".join(run.label for run in runs))
    # Fixed margins, not tight_layout: the grid and its titles are always the same, and measuring
    # every tick label took ~40% of the plot's time, paid at the end of every training run.
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.06, top=0.91, wspace=0.2, hspace=0.3)
    return fig


def save_plot(runs: Sequence[RecordedRun], output: str) -> str:
    """Draw ``runs`` into the PNG ``output`` with the Agg backend; raise ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = make_figure(plt, runs)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
