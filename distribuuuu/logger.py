"""Rank-aware logging: rank 0 to stdout (or the progress bar) and log.txt, the other ranks warnings only.

The ground floor: the metrics writer, trackers and summaries live above it (records/).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from distribuuuu.progress import ProgressBarHandler

LOG_NAME = "distribuuuu"
_FORMAT = "[%(asctime)s %(name)s] %(message)s"
# ``extra=SAME_ON_EVERY_RANK`` marks a warning every rank finds alike (the weights all ranks load):
# rank 0 says it; the other ranks, which print only warnings, leave it out rather than repeat it.
_SAME = "same_on_every_rank"
SAME_ON_EVERY_RANK = {_SAME: True}


def setup_logging(
    out_dir: str | None, rank: int, progress_bar: bool = False, console: bool = True, pending: bool = False
) -> logging.Logger:
    """Rank 0 logs INFO to stdout and OUT_DIR/log.txt; other ranks only warnings (not those marked
    SAME_ON_EVERY_RANK), to stderr.

    With ``progress_bar`` (stdout is a terminal), rank 0's stdout shows the training windows as a
    bar rather than as lines (see progress.py); log.txt still gets every line. Without ``console``
    rank 0 writes log.txt alone, for a tool whose stdout is its own report (gpu_check's table).
    With ``pending`` (and no ``out_dir``), rank 0 keeps the lines for log.txt until
    ``attach_log_file``: a run writes OUT_DIR only once its inputs proved good.
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
        elif pending:
            handlers.append(logging.handlers.MemoryHandler(capacity=10**9, flushLevel=logging.CRITICAL + 1))
        fmt = logging.Formatter(_FORMAT, "%m/%d %H:%M:%S")
    else:
        log.setLevel(logging.WARNING)
        handlers = [logging.StreamHandler(sys.stderr)]
        handlers[0].addFilter(lambda record: not getattr(record, _SAME, False))
        fmt = logging.Formatter(f"[rank {rank} %(asctime)s] %(message)s", "%m/%d %H:%M:%S")
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)
    return log


def attach_log_file(out_dir: str) -> None:
    """Start OUT_DIR/log.txt on rank 0 with the lines kept since ``setup_logging(pending=True)``."""
    log = logging.getLogger(LOG_NAME)
    for kept in [h for h in log.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        file = logging.FileHandler(os.path.join(out_dir, "log.txt"))
        file.setFormatter(kept.formatter)
        kept.setTarget(file)
        kept.flush()  # each line with its own time: the records keep when they were made
        log.removeHandler(kept)
        kept.close()
        log.addHandler(file)


def get_logger(name: str = "") -> logging.Logger:
    """A child of the distribuuuu logger (``distribuuuu.trainer`` etc.)."""
    return logging.getLogger(f"{LOG_NAME}.{name}" if name else LOG_NAME)
