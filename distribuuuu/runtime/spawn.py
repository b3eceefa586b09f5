"""The spawn launcher (``--nproc N``): N local workers started by torch.multiprocessing with the
variables torchrun would set, beside the launchers it detects (launcher.py). The first worker to
fail has its one error line printed once; preemption signals and Ctrl-C reaching the parent are
relayed to the workers, as torchrun does."""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from typing import Callable

from distribuuuu.errors import EXIT_FAILED, EXIT_INTERRUPTED, first_line
from distribuuuu.runtime.launcher import SPAWN_ERROR_VAR, find_free_port
from distribuuuu.runtime.preemption import EXIT_PREEMPTED, INTERRUPT, PREEMPT_SIGNALS


def _spawn_worker(local_rank: int, nproc: int, port: int, run: Callable, cfg, errors: str) -> None:
    """One worker: the variables torchrun would set, then ``run(cfg)`` (an exit code); exits with it."""
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ[SPAWN_ERROR_VAR] = os.path.join(errors, f"{local_rank}.json")
    code = run(cfg)
    if code:
        sys.exit(code)


def spawn_workers(run: Callable[[object], int], nproc: int, cfg) -> int:
    """Run ``run(cfg)`` in ``nproc`` local workers started with torch.multiprocessing, set up exactly as
    torchrun would; ``run`` returns the worker's exit code (``cli.run_main``: errors as one line).

    Preemption signals that reach this parent are forwarded to the workers (as torchrun does), so
    they checkpoint and exit with EXIT_PREEMPTED instead of dying with the parent.
    """
    with tempfile.TemporaryDirectory(prefix="distribuuuu-spawn-") as errors:
        return _join(_start_workers(run, nproc, cfg, errors), errors)


def _start_workers(run: Callable[[object], int], nproc: int, cfg, errors: str):
    import torch.multiprocessing as mp

    args = (nproc, find_free_port(), run, cfg, errors)
    return mp.start_processes(_spawn_worker, args=args, nprocs=nproc, join=False, start_method="spawn")


def _join(context, errors: str) -> int:
    """Wait for the workers; the exit code of the first to fail, its error line printed once."""
    import torch.multiprocessing as mp

    previous = _forward_signals([p.pid for p in context.processes])
    try:
        _let_stopping_workers_end(context)
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code and e.exit_code > 0:
            _print_worker_error(os.path.join(errors, f"{e.error_index}.json"))
            return e.exit_code
        print(f"distribuuuu: error: {first_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    except mp.ProcessRaisedException as e:
        print(f"distribuuuu: error: a worker failed:\n{e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _let_stopping_workers_end(context, grace_s: float = 30.0) -> None:
    """Wait for the first worker to end; if it stopped for a signal (Ctrl-C, preemption), give the
    others ``grace_s`` to end on their own, as they do at the same step.

    torch's ``join`` terminates the workers still running as soon as one exits non-zero (with a
    warning): rank 0 may still be writing the checkpoint the signal asked for. Any other failure
    leaves them to ``join`` at once: a peer of a crashed worker may hang in a collective.
    """
    ended = [context.processes[context.sentinels[s]] for s in multiprocessing.connection.wait(list(context.sentinels))]
    for process in ended:
        process.join()  # its sentinel closes as it exits, a moment before its exit code is there
    codes = {process.exitcode for process in ended}
    if codes & {EXIT_INTERRUPTED, EXIT_PREEMPTED}:
        deadline = time.monotonic() + grace_s
        while (alive := [p.sentinel for p in context.processes if p.is_alive()]) and time.monotonic() < deadline:
            multiprocessing.connection.wait(alive, timeout=max(deadline - time.monotonic(), 0))


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
