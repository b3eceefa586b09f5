"""Turning exceptions into the one-line messages the tools print (no dependencies, imported by all)."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
