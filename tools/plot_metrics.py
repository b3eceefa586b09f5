"""Plot the per-epoch metrics of one or more distribuuuu runs into one PNG.

Usage:
    python tools/plot_metrics.py OUT_DIR [OUT_DIR ...] [-o out.png] [--labels NAME ...]

Reads OUT_DIR/metrics.jsonl of each run (one JSON object per line, written by the trainer) and
draws a 2x2 grid: loss, top-1 accuracy (a multi-label run's val mAP and F1 macro), learning rate
and training throughput (images/s) against the epoch, ticked at whole epochs. Several runs are
overlaid, each in its own colour and labelled by its OUT_DIR's base name (or by --labels). Train
curves are thin lines, val curves carry markers (mAP circles, F1 triangles), and val curves of the
EMA weights (lines with "weights": "ema") are dashed; a star marks the evaluation the run chose as
its best (the val line marked "best": TRAIN.BEST_METRIC), on the loss or the metric axis. Lines of
the "test" split are ignored. A resumed run may log an epoch twice: the last line per (epoch,
split, weights) wins.

The PNG goes to -o if given, else to OUT_DIR/metrics.png for a single run and ./metrics.png for
several. Needs matplotlib (pip install -e ".[plot]"); draws with the Agg backend, no display.

Exit status: 0 written, 1 a metrics.jsonl is missing, empty or unreadable, 2 usage error or
matplotlib missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.errors import tool_error  # noqa: E402
from distribuuuu.records.metrics_file import MetricsError  # noqa: E402
from distribuuuu.records.plots import PLOT_INSTALL, load_run, save_plot  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Plot loss, top-1, learning rate and images/s per epoch of distribuuuu runs."
    )
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="run output directories")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: see module docstring)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend names, one per OUT_DIR, in order")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.out_dirs):
        parser.error(f"--labels has {len(args.labels)} names for {len(args.out_dirs)} OUT_DIRs")
    return args


def default_output(out_dirs: Sequence[str]) -> str:
    if len(out_dirs) == 1:
        return os.path.join(out_dirs[0], "metrics.png")
    return "metrics.png"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    labels = args.labels or [None] * len(args.out_dirs)
    try:
        runs = [load_run(d, label) for d, label in zip(args.out_dirs, labels)]
    except MetricsError as e:  # bad input, exit 2 as in every tool
        return tool_error(PROG, e)
    try:
        output = save_plot(runs, args.output or default_output(args.out_dirs))
    except ImportError:
        return tool_error(PROG, f"needs matplotlib: {PLOT_INSTALL}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
