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
from typing import Any

from distribuuuu.errors import EXIT_INTERRUPTED
from distribuuuu.runtime.launcher import detect_env_rank


def imported(module: str, name: str) -> Any:
    """``module``'s ``name``. A Ctrl-C during the import lets it finish, then ends the process with
    exit code 130 and one line from rank 0, as one during the set-up does. A Ctrl-C the process
    ignores (``nohup``, a shell's ``&``) stays ignored."""
    pressed: list[int] = []
    holding = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if holding:
        signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        entry = getattr(importlib.import_module(module), name)
    finally:
        if holding:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        if detect_env_rank() == 0:
            print("distribuuuu: interrupted (Ctrl-C) while starting; nothing saved", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    return entry
