"""One-line errors: ConfigError, CheckpointError, and exceptions turned into the lines the tools print.

No dependencies: imported by all."""

from __future__ import annotations

import re
import sys

# Every tool's exit codes (a preempted run exits with runtime/preemption.py's EXIT_PREEMPTED, 75):
EXIT_FAILED = 1  # a run that failed while training (bad image, non-finite loss, collective timeout)
EXIT_BAD_INPUT = 2  # stopped before anything ran: bad config, data, launcher environment, checkpoint, command line
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT): 128 + 2, what a shell reports for it
# A terminal's Ctrl-C reaches every process of its group, and a launcher may pass the same one on:
# signals this close to the first are that one Ctrl-C, not a second.
SAME_CTRL_C_S = 1.0


class ConfigError(ValueError):
    """A config value or config file is invalid; the message names the key or file."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read, verified or trusted; the message names the file."""


class RefusedCheckpointError(CheckpointError):
    """A file handed us as a checkpoint that is none (an image, a config) or that would run code if
    loaded: bad input (exit 2), never moved aside as a torn checkpoint is, nothing of it run."""


def tool_error(prog: str, message: object, code: int = EXIT_BAD_INPUT) -> int:
    """Print ``prog: error: message`` (argparse's own form) on stderr; return ``code`` to exit with."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError that ``e`` is, was raised from, or was raised while handling (None if there is none).

    torch.save reports a failed write (a full disk) as a RuntimeError of its zip writer ("unexpected
    pos ...") raised while handling the OSError: the OSError is what names the cause.
    """
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def refused_global(e: BaseException) -> str:
    """What ``weights_only=True`` refused, as torch names it ("GLOBAL posix.system"), else its first
    line without the terminal escapes of torch's text."""
    refused = re.search(r"\bGLOBAL [\w.]+", str(e))
    return refused.group(0) if refused else re.sub(r"\x1b\[[0-9;]*m", "", first_line(e))[:200]
