"""What a start must not mix into its own record, moved aside (never deleted) into OUT_DIR/previous/NNN_<time>/.

A fresh run (nothing to resume) into a folder an earlier run wrote would append to that run's
metrics.jsonl and log.txt, and its summary would report the earlier records (a test of another
model among them) as its own: the earlier outputs are moved aside first. A resumed run trains
again from its checkpoint: the records written past that point (a kill between a record's append
and the checkpoint's rename, a checkpoint that failed to write) are moved aside, so each split
and epoch is recorded once, by the run that continues.
"""

from __future__ import annotations

import datetime
import glob
import os
from collections.abc import Iterable

from distribuuuu.files import write_bytes
from distribuuuu.records.metrics_file import METRICS_FILE, split_after

PREVIOUS_DIR = "previous"
# What a run writes into OUT_DIR beside its config and checkpoints (the caller names those):
# docs/out-dir.md's layout. Anything else in the folder is not a run's and stays where it is.
RECORD_OUTPUTS = (
    METRICS_FILE, "log.txt", "summary.md", "metrics.png", "tb", "starts", "evaluation", "trackers.json", "wandb",
    "mlruns",
)  # fmt: skip
EVALUATIONS = "eval_*"  # test_net.py's folders beside a run's checkpoints (they evaluated the earlier run's)


def numbered_folder(parent: str) -> str:
    """Create and return ``parent``/NNN_<time>/, NNN one more than the numbered folders already there."""
    os.makedirs(parent, exist_ok=True)
    number = 1 + sum(1 for name in os.listdir(parent) if name[:3].isdigit())
    folder = os.path.join(parent, f"{number:03d}_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(folder)
    return folder


def earlier_outputs(out_dir: str, names: Iterable[str]) -> list[str]:
    """The entries of ``out_dir`` an earlier run wrote: ``names`` and the records' (an empty folder is nothing)."""
    found = [
        *RECORD_OUTPUTS,
        *names,
        *sorted(os.path.basename(p) for p in glob.glob(os.path.join(out_dir, EVALUATIONS))),
    ]
    present = []
    for name in dict.fromkeys(found):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            present.append(name)
    return present


def set_aside_earlier_run(out_dir: str, names: Iterable[str]) -> str | None:
    """Move an earlier run's outputs (``earlier_outputs``) into OUT_DIR/previous/NNN_<time>/; what to log, or None."""
    present = earlier_outputs(out_dir, names)
    if not present:
        return None
    folder = numbered_folder(os.path.join(out_dir, PREVIOUS_DIR))
    for name in present:
        os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return (
        f"OUT_DIR {out_dir} holds an earlier run's outputs that this run does not resume (no checkpoint to resume, "
        f"or TRAIN.AUTO_RESUME False): moved {', '.join(present)} to {folder} (nothing deleted); this run starts afresh"
    )


def set_aside_records_after(out_dir: str, epochs_done: int, resumed_from: str) -> str | None:
    """Move metrics.jsonl's training and validation records past ``epochs_done`` (the resumed checkpoint's
    completed epochs) into OUT_DIR/previous/NNN_<time>/metrics.jsonl; what to log, or None."""
    path = os.path.join(out_dir, METRICS_FILE)
    kept, later = split_after(path, epochs_done)
    if not later:
        return None
    aside = os.path.join(numbered_folder(os.path.join(out_dir, PREVIOUS_DIR)), METRICS_FILE)
    write_bytes(aside, later)  # the copy first: a crash in between leaves them twice, never lost
    write_bytes(path, kept)
    count = later.count(b"\n")
    return (
        f"resuming from {resumed_from}: moved the {count} record(s) of metrics.jsonl past it (epochs "
        f"after {epochs_done}, written before it was resumed) to {aside}; this run writes them again, and log.txt's "
        "lines above this one from that point on are the earlier start's"
    )
