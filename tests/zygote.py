"""Start ``python script.py ...`` and ``python -m module ...`` launches of the test suite without
paying the interpreter's start-up each time.

Importing torch and torchvision costs ~5 s of CPU per process (torchvision.ops pulls in
torch._dynamo); the suite starts a few hundred processes, so start-up alone took a third of it.
Python's own ``forkserver`` start method serves: one server process imports the heavy modules
once, then forks a child per launch. Each child takes the command's environment, working
directory, argv and ``sys.path``, writes its stdout/stderr to files, leads a session of its own
(the caller kills the whole group on a timeout), runs the script as ``__main__``, and ends as the
interpreter would: non-daemon threads joined, ``atexit`` handlers run, the exit code of
``SystemExit`` or 1 after a traceback. Signals reach the child itself (its pid is the process's),
so SIGTERM/SIGKILL tests behave as with a fresh interpreter.

What a fork cannot redo is what the preloaded modules read from the environment when they were
imported. Only torch, torchvision, the torchrun agent and distribuuuu (which reads the
environment when called, not on import) are preloaded, and the OpenMP thread count, which the
runtime reads once at start-up, is set from ``OMP_NUM_THREADS`` in the child. A test that needs a
truly fresh interpreter passes ``fresh=True`` to ``helpers.run``; ``DISTRIBUUUU_TEST_FORK=0``
runs every launch that way.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import traceback
from pathlib import Path

PRELOAD = ["torch", "torchvision", "torch.distributed.run", "distribuuuu.utils", "distribuuuu.trainer"]
ENABLED = os.environ.get("DISTRIBUUUU_TEST_FORK", "1") != "0"

_lock = threading.Lock()
_context = None


def forkable(cmd: list[str]) -> bool:
    """``python script.py ...`` or ``python -m module ...`` with this interpreter and no flags."""
    if not ENABLED or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return cmd[1] == "-m" and len(cmd) > 2 or not cmd[1].startswith("-")


def _forkserver():
    global _context
    with _lock:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def start(cmd: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path):
    """Start ``cmd`` (see ``forkable``) as a child of the fork server: the started Process."""
    process = _forkserver().Process(target=_main, args=(cmd[1:], env, str(cwd), str(stdout), str(stderr)))
    process.start()
    return process


def _main(args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect(1, stdout)
    _redirect(2, stderr)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, not forkserver
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    module = args[1] if args[0] == "-m" else None
    first = cwd if module else str(Path(args[0]).resolve().parent)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *(p for p in sys.path if p not in (first, *extra))]
    sys.argv = [args[0], *args[2:]] if module else list(args)
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    os._exit(_finish(code))


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)
    stream = open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    stream.reconfigure(line_buffering=True, write_through=True)
    setattr(sys, "stdout" if fd == 1 else "stderr", stream)


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What the interpreter does at exit: wait for non-daemon threads, run the atexit handlers."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code
