"""OUT_DIR/metrics.jsonl on disk: the one reader of its records and the repair of a torn last line.

The file is append-only, one JSON object a line. A run that dies mid-append (a full disk, a power
cut, a kill) can leave half a record without its newline. Every reader goes through
``read_records``, which skips such a line with one warning instead of refusing the file; the
writer calls ``repair_torn_tail`` before it appends, so the next record is not glued onto the torn
one. The writer lives above (writer.py); the plots and the summary read through here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from distribuuuu.logger import get_logger

logger = get_logger("metrics")

METRICS_FILE = "metrics.jsonl"
Record = dict[str, Any]
_TAIL_CHUNK = 1 << 16  # how far back at a time to look for the last newline: records are short


class MetricsError(Exception):
    """A metrics file is missing, empty or unreadable; the message names the file."""


def read_records(path: str) -> list[Record]:
    """Parse a metrics.jsonl file, skipping unparseable lines with one warning; raise MetricsError if missing or empty."""
    if not os.path.isfile(path):
        raise MetricsError(f"metrics file not found: {path}")
    records, skipped = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            record = _parse(line)
            if isinstance(record, dict):
                records.append(record)
            elif record is not None:
                skipped.append(lineno)
    if skipped:
        lines = ", ".join(map(str, skipped))
        logger.warning("%s: skipped line(s) %s: not a JSON object (a run stopped mid-write?)", path, lines)
    if not records:
        raise MetricsError(f"metrics file is empty: {path}")
    return records


_BAD = object()  # what _parse returns for a line that is not JSON: neither a record nor blank


def _parse(line: str) -> Any:
    """The line's JSON value; None for a blank line, ``_BAD`` for one that does not parse."""
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return _BAD


def split_after(path: str, epoch: int) -> tuple[bytes, bytes]:
    """``path``'s lines as written, in two: the rest, and the training and validation records past
    ``epoch`` (a resume's completed epochs: what the resumed run writes again). Test records
    (tools/test_net.py's, each of a checkpoint it names) and lines that are not records stay."""
    if not os.path.isfile(path):
        return b"", b""
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    later = [line for line in lines if _past(line, epoch)]
    return b"".join(line for line in lines if not _past(line, epoch)), b"".join(later)


def _past(line: bytes, epoch: int) -> bool:
    record = _parse(line.decode("utf-8", errors="replace"))
    if not isinstance(record, dict) or record.get("split") == "test":
        return False
    return isinstance(record.get("epoch"), (int, float)) and record["epoch"] > epoch


def repair_torn_tail(path: str) -> None:
    """Before appending to ``path``: end a complete last line with its newline, cut a torn one off (with a warning)."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        start = _last_line_start(f, size)
        f.seek(start)
        last = f.read()
        if not last or last.endswith(b"\n"):
            return
        if _parse(last.decode("utf-8", errors="replace")) not in (None, _BAD):
            f.write(b"\n")  # a whole record whose newline was lost: keep it, and end it
            return
        # One truncate to the end of the last whole line: every complete record stays as it was.
        f.truncate(start)
        f.flush()
        os.fsync(f.fileno())
    lineno = _count_newlines(path, start) + 1
    logger.warning(
        "%s:%d: removed a torn last line (%d bytes, a run stopped mid-write) before appending", path, lineno, len(last)
    )


def _last_line_start(f, size: int) -> int:
    """The offset just past the last newline before the final byte of the open file ``f`` (0 if none)."""
    end = size - 1  # a newline as the very last byte ends the last line; it does not start one
    while end > 0:
        begin = max(0, end - _TAIL_CHUNK)
        f.seek(begin)
        cut = f.read(end - begin).rfind(b"\n")
        if cut >= 0:
            return begin + cut + 1
        end = begin
    return 0


def _count_newlines(path: str, upto: int) -> int:
    with open(path, "rb") as f:
        return f.read(upto).count(b"\n")
