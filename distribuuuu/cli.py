"""What the command-line tools share: argument parsing, running a tool here or in ``--nproc`` workers,
and its errors as one line and an exit code (errors.py holds the codes)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import record
from yacs.config import CfgNode

from distribuuuu.checkpointing.checkpoint import CheckpointError
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import BadImageError, DataError, DeviceMemoryError
from distribuuuu.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, RefusedCheckpointError, first_line
from distribuuuu.runtime.faults import CollectiveError, NonFiniteLossError
from distribuuuu.runtime.launcher import SPAWN_ERROR_VAR, LaunchError, RankLaunchError, detect_env_rank
from distribuuuu.runtime.preemption import Preempted
from distribuuuu.runtime.process_group import cleanup_distributed
from distribuuuu.runtime.spawn import spawn_workers
from distribuuuu.startup import interrupted_while_starting

# Errors raised identically on every rank: rank 0 alone prints them, so they appear once.
_SAME_ON_EVERY_RANK = (ConfigError, DataError, LaunchError, CheckpointError, NonFiniteLossError)
_KNOWN = _SAME_ON_EVERY_RANK + (BadImageError, DeviceMemoryError, CollectiveError)


def parse_args(argv: Sequence[str] | None = None, description: str = "") -> argparse.Namespace:
    """Parse ``--cfg FILE [KEY VALUE ...]``; also accept the old launcher's --local_rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cfg", dest="cfg_file", default=None, help="YAML config file")
    # torch.distributed.launch passes --local_rank (old) or --local-rank (torch >= 2.0); the value
    # is also in the LOCAL_RANK environment variable, which is what setup_distributed reads.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start N local worker processes without a launcher (torch.multiprocessing spawn)",
    )
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args


def run_tool(
    main: Callable[[CfgNode], object],
    argv: Sequence[str] | None = None,
    description: str = "",
    build_cfg: Callable[[str | None, Sequence[str]], CfgNode] = load_cfg,
) -> int:
    """Parse ``--cfg FILE KEY VALUE ...``, build the config with ``build_cfg`` (test_net.py's reads
    its checkpoint's), then run ``main(cfg)`` here or in ``--nproc`` workers."""
    args = parse_args(argv, description)
    if args.nproc > 1 and _launcher_in_env():
        _print_error(f"--nproc cannot be used under a launcher ({_launcher_in_env()}): it starts the processes")
        return EXIT_BAD_INPUT
    try:
        # Parsed before any worker starts: a bad config costs no process start-up and prints once.
        cfg = build_cfg(args.cfg_file, args.opts)
    except (ConfigError, CheckpointError) as e:
        _print_error(_one_line(e))
        return _exit_code(e)
    except KeyboardInterrupt:  # test_net.py reads its checkpoint here: seconds, before anything is written
        return interrupted_while_starting()
    if args.nproc > 1:
        return spawn(main, args.nproc, cfg)
    return run_main(main, cfg)


def run_main(main: Callable[[CfgNode], object], cfg: CfgNode) -> int:
    """Run ``main(cfg)`` and turn the known errors into one printed line and an exit code."""
    try:
        # Under torchrun, an unexpected exception's traceback goes to torchrun's failure summary too.
        (record(main) if "TORCHELASTIC_ERROR_FILE" in os.environ else main)(cfg)
    except Preempted as e:
        if detect_env_rank() == 0:  # every rank stops at the same step: one line says it
            print(f"distribuuuu: {e}; exiting with {e.exit_code} ({e.how_to_resume})", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:  # a Ctrl-C outside training's steps (set-up, the end): nothing to save
        if detect_env_rank() == 0:
            print("distribuuuu: interrupted (Ctrl-C) outside a training step; nothing new saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _KNOWN as e:
        everywhere = isinstance(e, RankLaunchError) or not isinstance(e, _SAME_ON_EVERY_RANK)
        _print_error(_one_line(e), every_rank=everywhere)
        return _exit_code(e)
    finally:
        # Every way a tool ends lets go of its process group before the interpreter exits: a group
        # left to the interpreter's exit can abort it ("terminate called without an active exception").
        cleanup_distributed()
    return 0


def _exit_code(e: Exception) -> int:
    return (
        EXIT_BAD_INPUT if isinstance(e, (ConfigError, DataError, LaunchError, RefusedCheckpointError)) else EXIT_FAILED
    )


def _print_error(message: str, every_rank: bool = False) -> None:
    """Print ``distribuuuu: error: message`` (on rank 0 alone unless ``every_rank``) and hand it to
    torchrun, or to ``spawn``'s parent."""
    line = f"distribuuuu: error: {message}"
    _write_elastic_error_file(line)
    spawned = os.environ.get(SPAWN_ERROR_VAR)
    # Under a launcher every rank hits the same error: rank 0 alone reports it. Under ``spawn`` the
    # parent does, for the worker that failed first: the others are stopped then, rank 0 perhaps
    # before it printed.
    printed = every_rank or (detect_env_rank() == 0 and not spawned)
    if printed:
        print(line, file=sys.stderr, flush=True)
    if spawned:
        with open(spawned, "w") as f:  # read once the worker has exited: no reader sees it half-written
            json.dump({"line": line, "printed": printed}, f)


def _write_elastic_error_file(line: str) -> None:
    """Write ``line`` where torchrun reads this worker's error (TORCHELASTIC_ERROR_FILE), if it set one.

    torchrun's failure summary shows the error file of the first rank to fail, or, without one,
    "Signal 15 (SIGTERM)" or a link to its docs. Every rank writes the line, so whichever rank
    torchrun sees fail first (or stops with SIGTERM) names the real error. The format is the one
    torchrun's own ``record`` writes (``ErrorHandler.record_exception``), our line as the traceback.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass  # the line is still printed; a missing error file costs only torchrun's summary


def _one_line(e: Exception) -> str:
    # A DataLoader worker's exception arrives wrapped with its traceback: keep the last line.
    text = str(e).strip()
    if "Original Traceback" in text:
        return text.splitlines()[-1].split(": ", 1)[-1]
    return first_line(e)


def _launcher_in_env() -> str:
    """Name the launcher that already started this process ('' if none)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun: RANK is set"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "MPI: OMPI_COMM_WORLD_SIZE or PMI_SIZE is set"
    # srun sets SLURM_STEP_NUM_TASKS; an sbatch script alone (one process) may spawn workers.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return "srun: SLURM_STEP_NUM_TASKS > 1"
    return ""


def spawn(main: Callable[[CfgNode], object], nproc: int, cfg: CfgNode) -> int:
    """Run ``main(cfg)`` in ``nproc`` local workers (``--nproc``; runtime/spawn.py), each as ``run_main`` runs it."""
    return spawn_workers(functools.partial(run_main, main), nproc, cfg)
