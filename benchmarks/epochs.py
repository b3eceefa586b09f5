"""DATA.DECODER batched over whole epochs of train_net.py: its log's windows (img/s, data wait a
step) and ``memory_reserved`` after each pass of each loader (train, val, precise BN).

    python -m benchmarks.epochs --json OUT.jsonl OUT_DIR DIR TRAIN.DATASET PHOTOS TEST.DATASET PHOTOS \\
        DATA.DECODER batched TRAIN.WORKERS 4 OPTIM.MAX_EPOCH 3 [KEY VALUE ...]

This is train_net.py's entry point (cli.run_tool(trainer.train_model)) with one hook: each
DeviceLoader pass, when it ends, logs its batches and the device's memory_reserved to the run's
log. With one side stream reused by every pass (data/prefetch.py), memory_reserved stays where the
first epoch left it; a stream a pass would leave each pass's resample memory behind. The first
window of the first epoch (compiling, the workers starting) is reported apart from the steady ones.
"""

from __future__ import annotations

import os
import re
import statistics
import sys

import torch

from benchmarks.common import emit, fail, guarded, parser
from distribuuuu import cli, trainer
from distribuuuu.data.loader import DeviceLoader
from distribuuuu.logger import get_logger

WINDOW = re.compile(r"epoch (\d+)/\d+\s+step (\d+)/(\d+)\s.*?([\d.]+) img/s\s+data ([\d.]+)s/step")
PASS = re.compile(r"loader pass (\d+): (\d+) batches, memory_reserved ([\d.]+) MiB")


def log_each_pass() -> None:
    """Make every DeviceLoader pass log its batches and memory_reserved when it ends."""
    iterate, logger, passes = DeviceLoader.__iter__, get_logger("bench"), [0]

    def logged(self):
        batches = 0
        try:
            for batch in iterate(self):
                batches += 1
                yield batch
        finally:  # the training epoch leaves its iterator after its last step: closed, not exhausted
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(self.device)
            passes[0] += 1
            reserved = torch.cuda.memory_reserved(self.device) / 2**20 if cuda else 0.0
            logger.info("loader pass %d: %d batches, memory_reserved %.1f MiB", passes[0], batches, reserved)

    DeviceLoader.__iter__ = logged


def read_log(path: str) -> tuple[list[dict], list[dict]]:
    """The windows and the passes the run's log holds."""
    windows, passes = [], []
    with open(path) as f:
        for line in f:
            if m := WINDOW.search(line):
                epoch, step, last, rate, data = m.groups()
                windows.append(
                    {"epoch": int(epoch), "step": int(step), "img_per_s": float(rate), "data_s": float(data)}
                )
            elif m := PASS.search(line):
                passes.append({"pass": int(m[1]), "batches": int(m[2]), "reserved_mib": float(m[3])})
    return windows, passes


def summary(windows: list[dict], passes: list[dict]) -> list[dict]:
    """Per epoch: the median img/s and mean data wait of its windows (the run's first apart); the passes."""
    rows = []
    for epoch in sorted({w["epoch"] for w in windows}):
        steady = [w for w in windows if w["epoch"] == epoch and w is not windows[0]]
        if steady:
            rows.append({
                "what": "epoch", "epoch": epoch, "windows": len(steady),
                "img_per_s_median": statistics.median(w["img_per_s"] for w in steady),
                "img_per_s": [w["img_per_s"] for w in steady],
                "data_s_per_step": round(statistics.mean(w["data_s"] for w in steady), 4),
            })  # fmt: skip
    first = windows[0] if windows else {}
    return [
        {"what": "first_window", **first},
        *rows,
        {
            "what": "passes",
            "reserved_mib": [p["reserved_mib"] for p in passes],
            "batches": [p["batches"] for p in passes],
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parsed = parser(__doc__).parse_args(argv)
    if "OUT_DIR" not in parsed.opts:
        return fail("give OUT_DIR DIR: the run's log is read from it")
    log_each_pass()
    code = cli.run_tool(trainer.train_model, parsed.opts)
    log = os.path.join(parsed.opts[parsed.opts.index("OUT_DIR") + 1], "log.txt")
    if not os.path.exists(log):
        return code or fail(f"the run wrote no {log}")
    windows, passes = read_log(log)
    for row in summary(windows, passes):
        emit(row, parsed.json)
    return code


if __name__ == "__main__":
    sys.exit(guarded(main))
