"""What every measurement shares: its command line, its device, its timer, its JSON lines."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Callable

import torch

from distribuuuu.config import ConfigError
from distribuuuu.data import DataError
from distribuuuu.errors import first_line
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import setup_distributed


def parser(description: str) -> argparse.ArgumentParser:
    """A parser with ``--json FILE`` and the config's ``KEY VALUE`` overrides (``opts``)."""
    parsed = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parsed.add_argument("--json", default="", help="append each result as a JSON line to this file")
    parsed.add_argument("opts", nargs=argparse.REMAINDER, help="config KEY VALUE overrides")
    return parsed


def emit(record: dict, json_path: str = "") -> None:
    """Print one result as a JSON line (and append it to ``json_path``)."""
    line = json.dumps(record)
    print(line, flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(line + "\n")


def environment() -> DistEnv:
    """This process's device (its GPU, else the CPU); no process group."""
    return setup_distributed()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed(device: torch.device) -> Iterator[Callable[[], float]]:
    """Time the block: CUDA events on a GPU (the device's time from the first queued kernel to the
    last), the host clock on a CPU; the yielded function gives the seconds once the block is done."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        seconds: list[float] = []
        yield lambda: seconds[0]
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    else:
        tic, seconds = time.perf_counter(), []
        yield lambda: seconds[0]
        seconds.append(time.perf_counter() - tic)


def peak_gib(device: torch.device) -> float:
    """The device's peak allocated memory since the last reset, in GiB (0 on a CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def fail(message: str) -> int:
    """One line on stderr; exit status 2."""
    print(f"benchmarks: error: {message}", file=sys.stderr)
    return 2


def guarded(main: Callable[[], int]) -> int:
    """``main()``; a bad config or dataset is one line and exit status 2, not a traceback."""
    try:
        return main()
    except (ConfigError, DataError) as e:
        return fail(first_line(e))
