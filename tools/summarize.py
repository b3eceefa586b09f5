"""Summarise a run: ``python tools/summarize.py OUT_DIR [--no-write]``.

Prints the run's best and last val accuracy, training and validation time, training images/s, the
config keys that differ from the defaults, and draws OUT_DIR/metrics.png (with matplotlib, the
"plot" extra). Writes OUT_DIR/summary.md too, unless --no-write (then no plot either). Works on any
OUT_DIR with a metrics.jsonl, finished or not. Exit status: 0, or 2 when OUT_DIR holds no readable
metrics.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.config import ConfigError, run_config_changes  # noqa: E402
from distribuuuu.errors import tool_error  # noqa: E402
from distribuuuu.records.metrics_file import MetricsError  # noqa: E402
from distribuuuu.records.summary import NOTHING_TO_DRAW, format_summary, summarize, write_summary  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def main(argv: Sequence[str] | None = None) -> int:
    """Print the summary of OUT_DIR; a missing or unreadable metrics.jsonl is one line and exit 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", metavar="OUT_DIR", help="a training run's output directory")
    parser.add_argument("--no-write", action="store_true", help="print only: no summary.md, no plot")
    args = parser.parse_args(argv)
    try:
        changes = run_config_changes(args.out_dir)
        text = _printed_only(args.out_dir, changes) if args.no_write else write_summary(args.out_dir, True, changes)
    except (MetricsError, ConfigError, OSError) as e:
        return tool_error(PROG, e)
    print(text, end="")
    return 0


def _printed_only(out_dir: str, changes: list) -> str:
    summary = summarize(out_dir, config_changes=changes)
    summary.no_plot = (
        f"--no-write; python tools/plot_metrics.py {out_dir} draws it" if summary.drawable else NOTHING_TO_DRAW
    )
    return format_summary(summary)


if __name__ == "__main__":
    sys.exit(main())
