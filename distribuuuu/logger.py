"""Rank-aware logging, and the metrics writer (metrics.jsonl + TensorBoard) of the main process."""

from __future__ import annotations

import json
import logging
import os
import sys

LOG_NAME = "distribuuuu"
_FORMAT = "[%(asctime)s %(name)s] %(message)s"


def setup_logging(out_dir: str | None, rank: int) -> logging.Logger:
    """Rank 0 logs INFO to stdout and OUT_DIR/log.txt; other ranks only warnings, to stderr."""
    log = logging.getLogger(LOG_NAME)
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        log.setLevel(logging.INFO)
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
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


class MetricsWriter:
    """Appends one JSON object per line to OUT_DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: str, tensorboard: bool = True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None and "epoch" in record:
            prefix = record["split"] + ("_ema" if record.get("weights") == "ema" else "")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "k"):
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["epoch"])
            self.tb.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.tb is not None:
            self.tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class NullWriter:
    """The metrics writer of non-main ranks: does nothing."""

    def write(self, record: dict) -> None:
        pass

    def scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def make_writer(out_dir: str, is_main: bool, tensorboard: bool = True) -> MetricsWriter | NullWriter:
    """A MetricsWriter on the main process, a NullWriter elsewhere."""
    return MetricsWriter(out_dir, tensorboard) if is_main else NullWriter()
