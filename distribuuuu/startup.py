"""A tool's first seconds: loading torch, with a Ctrl-C meanwhile answered in one line.

Importing torch takes seconds. A KeyboardInterrupt raised inside it prints a long traceback on
every rank, or worse, leaves torch half-initialised so that a later line of it fails with another
error. So a tool imports its entry point through ``imported``, which holds a Ctrl-C until the
import is done and then stops. This module loads nothing that imports torch at its top.
"""

from __future__ import annotations

import importlib
import signal
import sys
import time
from typing import Any

from distribuuuu.errors import EXIT_INTERRUPTED, SAME_CTRL_C_S
from distribuuuu.runtime.launcher import detect_env_rank


def imported(module: str, name: str) -> Any:
    """``module``'s ``name``. A Ctrl-C during the import lets it finish, then ends the process as
    ``interrupted_while_starting`` does. A second Ctrl-C (more than SAME_CTRL_C_S after the first: an
    import that hangs) stops at once, with Python's traceback. A Ctrl-C the process ignores
    (``nohup``, a shell's ``&``) stays ignored."""
    pressed: list[float] = []

    def hold(signum: int, frame: Any) -> None:
        if pressed and time.monotonic() - pressed[0] > SAME_CTRL_C_S:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pressed[:] = pressed or [time.monotonic()]

    holding = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if holding:
        signal.signal(signal.SIGINT, hold)
    try:
        entry = getattr(importlib.import_module(module), name)
    finally:
        if holding:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        sys.exit(interrupted_while_starting())
    return entry


def interrupted_while_starting() -> int:
    """Say, from rank 0 alone, that a Ctrl-C stopped the tool before it did anything; its exit code."""
    if detect_env_rank() == 0:
        print("distribuuuu: interrupted (Ctrl-C) while starting; nothing saved", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
