"""What the command-line tools share: argument parsing, the spawn launcher, errors and exit codes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import record
from yacs.config import CfgNode

from distribuuuu.checkpointing.checkpoint import CheckpointError
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import BadImageError, DataError
from distribuuuu.errors import EXIT_INTERRUPTED, RefusedCheckpointError, first_line
from distribuuuu.runtime.faults import CollectiveError, NonFiniteLossError
from distribuuuu.runtime.launcher import SPAWN_ERROR_VAR, LaunchError, RankLaunchError, detect_env_rank, find_free_port
from distribuuuu.runtime.preemption import INTERRUPT, PREEMPT_SIGNALS, Preempted
from distribuuuu.runtime.process_group import cleanup_distributed
from distribuuuu.startup import interrupted_while_starting

EXIT_FAILED = 1  # a run that failed while training (bad image, non-finite loss, collective timeout)
EXIT_BAD_INPUT = 2  # stopped before training: bad config, data, launcher environment or checkpoint
# Errors raised identically on every rank: rank 0 alone prints them, so they appear once.
_SAME_ON_EVERY_RANK = (ConfigError, DataError, LaunchError, CheckpointError, NonFiniteLossError)
_KNOWN = _SAME_ON_EVERY_RANK + (BadImageError, CollectiveError)


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


def _spawn_worker(local_rank: int, nproc: int, port: int, main: Callable, cfg: CfgNode, errors: str) -> None:
    """One worker: the variables torchrun would set, then ``main(cfg)``; exits with its code."""
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ[SPAWN_ERROR_VAR] = os.path.join(errors, f"{local_rank}.json")
    code = run_main(main, cfg)
    if code:
        sys.exit(code)


def spawn(main: Callable[[CfgNode], object], nproc: int, cfg: CfgNode) -> int:
    """Start ``nproc`` local workers with torch.multiprocessing, set up exactly as torchrun would.

    Preemption signals that reach this parent are forwarded to the workers (as torchrun does), so
    they checkpoint and exit with EXIT_PREEMPTED instead of dying with the parent.
    """
    with tempfile.TemporaryDirectory(prefix="distribuuuu-spawn-") as errors:
        return _join(_start_workers(main, nproc, cfg, errors), errors)


def _start_workers(main: Callable[[CfgNode], object], nproc: int, cfg: CfgNode, errors: str):
    import torch.multiprocessing as mp

    args = (nproc, find_free_port(), main, cfg, errors)
    return mp.start_processes(_spawn_worker, args=args, nprocs=nproc, join=False, start_method="spawn")


def _join(context, errors: str) -> int:
    """Wait for the workers; the exit code of the first to fail, its error line printed once."""
    import torch.multiprocessing as mp

    previous = _forward_signals([p.pid for p in context.processes])
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code and e.exit_code > 0:
            _print_worker_error(os.path.join(errors, f"{e.error_index}.json"))
            return e.exit_code
        print(f"distribuuuu: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    except mp.ProcessRaisedException as e:
        print(f"distribuuuu: error: a worker failed:\n{e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _print_worker_error(path: str) -> None:
    """The line a failed worker handed over (``_print_error``), unless it printed it itself."""
    try:
        with open(path) as f:
            error = json.load(f)
    except (OSError, ValueError):  # no known error (it printed what it had), or none written
        return
    if not error["printed"]:
        print(error["line"], file=sys.stderr, flush=True)


def _forward_signals(pids: list[int]) -> dict:
    """Relay SIGTERM/SIGUSR1/SIGINT from this process to ``pids``; return the handlers it replaced.

    A terminal's Ctrl-C reaches the workers too: they take the relayed one for the same Ctrl-C.
    """

    def forward(signum, frame) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    names = (*PREEMPT_SIGNALS, INTERRUPT)
    return {getattr(signal, name): signal.signal(getattr(signal, name), forward) for name in names}
