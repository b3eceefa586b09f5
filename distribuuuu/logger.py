"""Rank-aware logging, and the metrics writer (metrics.jsonl, TensorBoard, trackers) of the main process."""

from __future__ import annotations

import json
import logging
import os
import sys

from yacs.config import CfgNode

from distribuuuu.progress import ProgressBarHandler

LOG_NAME = "distribuuuu"
_FORMAT = "[%(asctime)s %(name)s] %(message)s"


def setup_logging(out_dir: str | None, rank: int, progress_bar: bool = False, console: bool = True) -> logging.Logger:
    """Rank 0 logs INFO to stdout and OUT_DIR/log.txt; other ranks only warnings, to stderr.

    With ``progress_bar`` (stdout is a terminal), rank 0's stdout shows the training windows as a
    bar rather than as lines (see progress.py); log.txt still gets every line. Without ``console``
    rank 0 writes log.txt alone, for a tool whose stdout is its own report (gpu_check's table).
    """
    log = logging.getLogger(LOG_NAME)
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        log.setLevel(logging.INFO)
        stdout = ProgressBarHandler(sys.stdout) if progress_bar else logging.StreamHandler(sys.stdout)
        handlers: list[logging.Handler] = [stdout] if console else []
        if out_dir:
            handlers.append(logging.FileHandler(os.path.join(out_dir, "log.txt")))
        fmt = logging.Formatter(_FORMAT, "%m/%d %H:%M:%S")
    else:
        log.setLevel(logging.WARNING)
        handlers = [logging.StreamHandler(sys.stderr)]
        fmt = logging.Formatter(f"[rank {rank} %(asctime)s] %(message)s", "%m/%d %H:%M:%S")
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)
    return log


def get_logger(name: str = "") -> logging.Logger:
    """A child of the distribuuuu logger (``distribuuuu.trainer`` etc.)."""
    return logging.getLogger(f"{LOG_NAME}.{name}" if name else LOG_NAME)


# What TensorBoard and the trackers plot: the rest of a metrics.jsonl record (samples, step,
# time_s, skipped counts) is bookkeeping, kept in metrics.jsonl and out of the scalar dashboard.
CURVES = ("loss", "top1", "topk", "lr", "images_per_s")
WINDOW_PREFIX = "train_step"  # the PRINT_FREQ windows' tags, against the global optimizer step


class MetricsWriter:
    """Appends one JSON object per line to OUT_DIR/metrics.jsonl; plots the curves in TensorBoard and trackers."""

    def __init__(self, out_dir: str, tensorboard: bool = True, cfg: CfgNode | None = None):
        self.path, self.out_dir = os.path.join(out_dir, "metrics.jsonl"), out_dir
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
        self.trackers = None
        if cfg is not None and cfg.LOG.TRACKERS:
            from distribuuuu.tracking import Trackers  # only a run that asks for trackers imports them

            self.trackers = Trackers(cfg, out_dir)

    def write(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl; an epoch record's curves also go to TensorBoard and the trackers."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "epoch" in record:
            prefix = record["split"] + ("_ema" if record.get("weights") == "ema" else "")
            curves = {f"{prefix}/{k}": record[k] for k in CURVES if isinstance(record.get(k), (int, float))}
            self._plot(curves, "epoch", record["epoch"])

    def write_window(self, values: dict, global_step: int) -> None:
        """Plot one PRINT_FREQ window's values (host floats the sync point already has) at ``global_step``."""
        self._plot({f"{WINDOW_PREFIX}/{k}": v for k, v in values.items()}, "global_step", global_step)

    def _plot(self, scalars: dict, axis: str, step: int) -> None:
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.trackers is not None:
            self.trackers.log(scalars, axis, step)

    def summarize(self) -> None:
        """Write OUT_DIR/summary.md (and the plot) at the end of training, and log the summary."""
        from distribuuuu.plots import MetricsError
        from distribuuuu.summary import write_summary

        try:
            get_logger("summary").info("run summary:\n%s", write_summary(self.out_dir))
        except (MetricsError, OSError) as e:  # the run itself is done and saved: a summary never fails it
            get_logger("summary").warning("no run summary: %s", e)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close()


class NullWriter:
    """The metrics writer of non-main ranks: does nothing."""

    def write(self, record: dict) -> None:
        pass

    def write_window(self, values: dict, global_step: int) -> None:
        pass

    def summarize(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_writer(
    out_dir: str, is_main: bool, tensorboard: bool = True, cfg: CfgNode | None = None
) -> MetricsWriter | NullWriter:
    """A MetricsWriter on the main process (with the trackers of ``cfg.LOG``, if given), a NullWriter elsewhere."""
    return MetricsWriter(out_dir, tensorboard, cfg) if is_main else NullWriter()
