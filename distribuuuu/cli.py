"""What the command-line tools share: argument parsing, the spawn launcher, errors and exit codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Callable

from yacs.config import CfgNode

from distribuuuu.checkpoint import CheckpointError
from distribuuuu.config import ConfigError, load_cfg, parse_args
from distribuuuu.data import BadImageError, DataError
from distribuuuu.distributed import LaunchError, detect_env_rank, find_free_port
from distribuuuu.faults import EXIT_PREEMPTED, CollectiveError, NonFiniteLossError, Preempted

EXIT_FAILED = 1  # a run that failed while training (bad image, non-finite loss, collective timeout)
EXIT_BAD_INPUT = 2  # stopped before training: bad config, data, launcher environment or checkpoint
# Errors raised identically on every rank: rank 0 alone prints them, so they appear once.
_SAME_ON_EVERY_RANK = (ConfigError, DataError, LaunchError, CheckpointError, NonFiniteLossError)
_KNOWN = _SAME_ON_EVERY_RANK + (BadImageError, CollectiveError)


def run_tool(main: Callable[[CfgNode], object], argv: Sequence[str] | None = None, description: str = "") -> int:
    """Parse ``--cfg FILE KEY VALUE ...``, then run ``main(cfg)`` here or in ``--nproc`` workers."""
    args = parse_args(argv, description)
    if args.nproc > 1:
        return spawn(main, args.nproc, [a for a in (["--cfg", args.cfg_file] if args.cfg_file else [])] + args.opts)
    try:
        main(load_cfg(args.cfg_file, args.opts))
    except Preempted as e:
        print(f"distribuuuu: {e}; exiting with {EXIT_PREEMPTED} (resume with TRAIN.AUTO_RESUME True)", file=sys.stderr)
        return EXIT_PREEMPTED
    except _KNOWN as e:
        rank = detect_env_rank()
        if rank == 0 or not isinstance(e, _SAME_ON_EVERY_RANK):
            print(f"distribuuuu: error: {_one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT if isinstance(e, (ConfigError, DataError, LaunchError)) else EXIT_FAILED
    return 0


def _one_line(e: Exception) -> str:
    # A DataLoader worker's exception arrives wrapped with its traceback: keep the last line.
    text = str(e).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(e).__name__


def _spawn_worker(local_rank: int, nproc: int, port: int, main: Callable, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = run_tool(main, argv)
    if code:
        sys.exit(code)


def spawn(main: Callable[[CfgNode], object], nproc: int, argv: list[str]) -> int:
    """Start ``nproc`` local workers with torch.multiprocessing, set up exactly as torchrun would."""
    import torch.multiprocessing as mp

    if "RANK" in os.environ:
        print("distribuuuu: error: --nproc cannot be used under a launcher (RANK is set)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        mp.spawn(_spawn_worker, args=(nproc, find_free_port(), main, argv), nprocs=nproc, join=True)
    except mp.ProcessExitedException as e:
        return e.exit_code if e.exit_code and e.exit_code > 0 else EXIT_FAILED
    return 0
