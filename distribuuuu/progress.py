"""The progress bar a person at a terminal sees: a logging handler on rank 0's stdout.

The trainer logs one line per PRINT_FREQ window, with the window's numbers attached (``extra``).
On a terminal this handler draws those numbers as a bar that it rewrites in place, instead of
printing the line; every other record clears the bar, prints, and redraws it. The bar therefore
moves only at the sync points, from values already on the host: it adds no host sync. log.txt
keeps every line. Written here rather than taken from tqdm/rich: ~60 lines, and no dependency.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

WINDOW = "window"  # the ``extra`` attribute of a window's log record: a dict of its numbers
_CLEAR = "\r\x1b[K"  # carriage return, then erase to the end of the line


def show_progress_bar(enabled: bool, stream: TextIO | None = None) -> bool:
    """True when LOG.PROGRESS is on, the stream is a terminal, and we are not in a Slurm job."""
    stream = stream or sys.stdout
    return enabled and stream.isatty() and "SLURM_JOB_ID" not in os.environ


def format_bar(w: dict, width: int = 24) -> str:
    """``epoch 1/2 [#######.......]  10/25  loss 2.1043  1234 img/s  eta 0:00:12``."""
    done = int(width * w["step"] / max(w["last_step"], 1))
    return (
        f"epoch {w['epoch']}/{w['max_epoch']} [{'#' * done}{'.' * (width - done)}] "
        f"{w['step']}/{w['last_step']}  loss {w['loss']:.4f}  {w['images_per_s']:.0f} img/s  eta {w['eta']}"
    )


class ProgressBarHandler(logging.StreamHandler):
    """Draw window records as an in-place bar; print every other record above it."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__(stream or sys.stdout)
        self.bar = ""  # the bar currently on screen ("" when none)

    def emit(self, record: logging.LogRecord) -> None:
        window = getattr(record, WINDOW, None)
        try:
            if window is None:
                self.stream.write(_CLEAR + self.format(record) + "\n" + self.bar)
            else:
                self.bar = format_bar(window)
                self.stream.write(_CLEAR + self.bar)
                if window["step"] == window["last_step"]:
                    self.stream.write("\n")  # the finished epoch's bar stays on screen
                    self.bar = ""
            self.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)

    def close(self) -> None:
        if self.bar:
            self.stream.write("\n")
            self.bar = ""
        super().close()
