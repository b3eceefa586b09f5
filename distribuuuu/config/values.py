"""A config value as the user gave it: read (a command-line string as a Python literal, bounded in
length) and shown in messages (cut short, so that no message grows with the value)."""

from __future__ import annotations

import ast
import reprlib
from typing import Any

from distribuuuu.errors import ConfigError

# A config value is at most a few lists of paths or patterns: a longer string (a million-item
# OPTIM.STEPS, 20 s of literal_eval and deep copies here) is refused before it is read.
_MAX_VALUE_CHARS = 64 * 1024


def decode(value: Any, key: str = "") -> Any:
    """A command-line value as Python (``0.1``, ``[1, 2]``, ``True``), or the string itself, as yacs does;
    ``key`` (with its source) names the value in a ConfigError."""
    if not isinstance(value, str):
        return value
    if len(value) > _MAX_VALUE_CHARS:
        raise ConfigError(
            f"{key}: a value of {len(value):,} characters is too long for a config value (at most 64 KiB)"
        )
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    except (RecursionError, MemoryError):  # Python's parser gives up on "-" * 3000 + "1" so, not on memory
        raise ConfigError(f"{key}: cannot read {shown(value)}, nested too deeply") from None


# How a message shows a value the user gave: reprlib's repr, cut short, so that no message grows with
# the value (a million-item OPTIM.STEPS is named in a line, at once).
_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 12
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80
_REPR.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)``, at most ~100 characters."""
    return clip(_REPR.repr(value))


def shown_key(key: Any) -> str:
    """A key as typed, cut short; quoted and escaped if it is empty, or spaced or broken at either end."""
    key = str(key)
    return clip(key) if key.isprintable() and key.strip() == key != "" else shown(key)


def clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
