"""A run's summary from its OUT_DIR: best and last accuracy, time, images/s, config changes, plot.

Read from what the run leaves behind (metrics.jsonl; the config changes its caller reads from
config.yaml, ``config.changes_from_defaults``), so the same summary comes at
the end of training (summary.md, written by rank 0's metrics writer) and from
``tools/summarize.py OUT_DIR`` for any run, finished or not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from distribuuuu.records.metrics_file import METRICS_FILE, Record, read_records
from distribuuuu.records.plots import (
    HEADLINE,
    METRIC_NAMES,
    PERCENT,
    PLOT_INSTALL,
    best_record,
    dedupe,
    headline,
    load_run,
    save_plot,
)
from distribuuuu.records.starts import read_starts

SUMMARY_FILE, PLOT_FILE = "summary.md", "metrics.png"


@dataclass
class Summary:
    """The numbers of a run's summary (accuracies in %, times in seconds)."""

    out_dir: str
    epochs: int = 0
    best: dict = field(default_factory=dict)  # the best val record by TRAIN.BEST_METRIC (model or EMA)
    best_metric: str = "top1"
    last: dict = field(default_factory=dict)  # weights ("model"/"ema") -> the last val record
    tested: list = field(
        default_factory=list
    )  # the last test record (tools/test_net.py) of each checkpoint and weights
    own_weights: set = field(default_factory=set)  # the SHA-256 prefixes of the weights this run evaluated (val)
    train_s: float = 0.0  # the train records' time: every epoch's training across the starts that trained it
    val_s: float = 0.0
    precise_bn_s: float = 0.0  # BN.PRECISE_IMAGES: the recomputation before each evaluation
    starts: list = field(default_factory=list)  # records/starts.py's Start of each start (OUT_DIR/starts/)
    images_per_s: float = 0.0  # training images over training time, all epochs
    config_changes: list = field(default_factory=list)  # (key, default, value)
    plot: str = ""
    no_plot: str = PLOT_INSTALL  # why there is none: what the summary says instead

    @property
    def drawable(self) -> bool:
        """Whether a plot would show anything: training or validation records (test ones are not drawn)."""
        return bool(self.epochs or self.last)


NOTHING_TO_DRAW = "no training or validation records to draw"


def summarize(out_dir: str, records: list[Record] | None = None, config_changes: list | None = None) -> Summary:
    """Summarise OUT_DIR's metrics.jsonl (or its ``records``, if already read; last record per epoch wins),
    with the run's ``config_changes`` from the defaults ((key, default, value), ``config.changes_from_defaults``)."""
    records = read_records(os.path.join(out_dir, METRICS_FILE)) if records is None else records
    series = dedupe(records)
    train = series.get(("train", "model"), [])
    vals = {w: recs for (split, w), recs in series.items() if split == "val" and recs}
    s = Summary(out_dir=out_dir, epochs=len(train))
    s.last = {w: recs[-1] for w, recs in vals.items()}
    s.tested = last_tests(records)
    s.own_weights = {_sha256(r) for r in records if r.get("split") == "val"} - {None}
    s.best = best_record([r for r in records if r.get("split") == "val"])
    s.best_metric = s.best.get("best", "top1")
    s.train_s = sum(r["time_s"] for r in train)
    s.val_s = sum(r["time_s"] for recs in vals.values() for r in recs)
    s.precise_bn_s = sum(r.get("precise_bn_s", 0.0) for recs in vals.values() for r in recs)
    s.starts = read_starts(out_dir)
    s.images_per_s = sum(r["samples"] for r in train) / s.train_s if s.train_s else 0.0
    s.config_changes = list(config_changes or [])
    return s


def format_summary(s: Summary) -> str:
    """The summary as short Markdown."""
    lines = [f"# Run summary: {s.out_dir}", "", f"- epochs trained: {s.epochs}"]
    if s.best:
        lines.append(_best_line(s.best, s.best_metric, _checkpoint_text(s.best, s.out_dir, best=True)))
    lines += [
        _evaluation_line("last val", weights, r, _checkpoint_text(r, s.out_dir))
        for weights, r in sorted(s.last.items())
    ]
    lines += [_test_line(s, r) for r in s.tested]
    if s.starts:
        lines.append(f"- starts: {len(s.starts)} ({'; '.join(start.describe() for start in s.starts)})")
    lines.append(_time_line(s))
    lines.append(f"- training throughput: {s.images_per_s:.0f} images/s")
    lines.append(f"- plot: {s.plot}" if s.plot else f"- plot: none ({s.no_plot})")
    lines += ["", "## Config changes from the defaults", ""]
    lines += [f"- `{k}`: {v!r} (default {d!r})" for k, d, v in s.config_changes] or ["- none"]
    return "\n".join(lines) + "\n"


def _time_line(s: Summary) -> str:
    """Training time (over the starts, when OUT_DIR records them), validation time and precise BN's."""
    starts = f" over {len(s.starts)} start{'s' if len(s.starts) != 1 else ''}" if s.starts else ""
    precise = f", {s.precise_bn_s:.1f} s precise BN" if s.precise_bn_s else ""
    return f"- time: {s.train_s:.1f} s training{starts}, {s.val_s:.1f} s validation{precise}"


def last_tests(records: list[Record]) -> list[Record]:
    """The last test record written of each checkpoint, weights ("model"/"ema") and TEST.TTA, in the order written."""
    last: dict[tuple, Record] = {}
    for r in records:
        if r.get("split") == "test":
            key = ((r.get("checkpoint") or {}).get("path"), r.get("weights", "model"), r.get("tta", ""))
            last.pop(key, None)
            last[key] = r
    return list(last.values())


def _sha256(record: Record) -> str | None:
    return (record.get("checkpoint") or {}).get("sha256")


def _checkpoint_text(record: Record, out_dir: str, best: bool = False) -> str:
    """'; checkpoints/ckpt_ep_003.pth.tar, weights 1a2b...' for a record that names its checkpoint, else ''.
    A checkpoint pruned since (TRAIN.KEEP_CKPTS) is said to be; the best's weights are then best.pth.tar's."""
    named = record.get("checkpoint")
    if not isinstance(named, dict) or not named.get("path"):
        return ""
    path, root = str(named["path"]), os.path.abspath(out_dir)
    shown = os.path.relpath(path, root) if path.startswith(root + os.sep) else path
    if not os.path.exists(path):
        kept = [n for n in ("best.pth.tar", "best.dcp") if os.path.exists(os.path.join(root, n))] if best else []
        shown = f"{kept[0]} (its checkpoint {shown} pruned since)" if kept else f"{shown} (pruned since)"
    return f"; {shown}" + (f", weights {named['sha256']}" if named.get("sha256") else "")


def _test_line(s: Summary, r: Record) -> str:
    """A test record's line; one of weights this run never evaluated is said to be another model's."""
    what = "test (test_net.py" + (f", {r['tta']} TTA)" if r.get("tta") else ")")
    line = _evaluation_line(what, r.get("weights", "model"), r, _checkpoint_text(r, s.out_dir))
    foreign = s.own_weights and _sha256(r) and _sha256(r) not in s.own_weights
    return line + (" — not this run's weights: none of its evaluations had them" if foreign else "")


def _best_line(best: dict, metric: str, checkpoint: str = "") -> str:
    """The best val record by TRAIN.BEST_METRIC, beside the run's headline metrics (mAP and F1 macro
    for a multi-label run, top-1 otherwise); named unless it is top-1, the default, of a top-1 run."""
    where = f"{best.get('weights', 'model')} weights, epoch {best['epoch']}{checkpoint}"
    headlines = headline(best)
    chosen = "" if headlines == HEADLINE == (metric,) else f" (TRAIN.BEST_METRIC {metric})"
    beside = [f"{METRIC_NAMES[f]} {best[f]:.2f}%, " for f in headlines if f != metric and f in best]
    return f"- best val {METRIC_NAMES[metric]}{chosen}: {_value(metric, best[metric])} ({''.join(beside)}{where})"


def _value(metric: str, value: float) -> str:
    """A metric's value as the other lines give it: a percentage to 2 decimals, a loss to 4."""
    return f"{value:.2f}%" if metric in PERCENT else f"{value:.4f}"


def _evaluation_line(what: str, weights: str, r: dict, checkpoint: str = "") -> str:
    if "map" in r:  # MODEL.TASK multilabel: its metrics, not a top-1 of one label per image
        return (
            f"- {what} mAP ({weights}): {r['map']:.2f}% (F1 macro {r['f1_macro']:.2f}%, micro {r['f1_micro']:.2f}%, "
            f"epoch {r['epoch']}{checkpoint})"
        )
    topk = f"top-{r['k']} {r['topk']:.2f}%, " if "k" in r else ""
    return f"- {what} top-1 ({weights}): {r['top1']:.2f}% ({topk}epoch {r['epoch']}{checkpoint})"


def write_summary(out_dir: str, plot: bool = True, config_changes: list | None = None) -> str:
    """Draw OUT_DIR/metrics.png (if ``plot`` and matplotlib is installed), write OUT_DIR/summary.md; return its text."""
    records = read_records(os.path.join(out_dir, METRICS_FILE))  # read once: a skipped line is one warning
    s = summarize(out_dir, records, config_changes)
    if not plot:
        s.no_plot = f"LOG.PLOT False; python tools/plot_metrics.py {out_dir} draws it"
    elif not s.drawable:
        s.no_plot = NOTHING_TO_DRAW
    else:
        try:
            s.plot = save_plot([load_run(out_dir, None, records)], os.path.join(out_dir, PLOT_FILE))
        except ImportError:
            pass  # matplotlib is the optional "plot" extra: the summary says how to get it
    text = format_summary(s)
    with open(os.path.join(out_dir, SUMMARY_FILE), "w") as f:
        f.write(text)
    return text
