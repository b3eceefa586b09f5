"""Durable file writes: the one place that knows how to replace a file or a folder atomically.

Every writer of the package (checkpoints, sharded checkpoints, packed shards and their index,
downloaded shards, evaluation artifacts) goes through here, so a crash, a kill or a full disk
mid-write leaves either the old content or the new, never half of one. The recipe is POSIX's:
write under a temporary name in the same folder (a rename is atomic only within one file
system), flush and fsync the data, rename over the target, then fsync the folder so the rename
itself survives a power loss. Python's standard library has no such helper (``tempfile`` and
``os.replace`` are the pieces), hence this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from distribuuuu.errors import os_error_in

PART = ".part"  # the suffix of every temporary name: what a cleanup may remove
# A failed write into a file system with less room than this is put down to a full disk: a short
# write fills a file system to its last block before the next one fails with ENOSPC.
FULL_BELOW = 1 << 20
_FULL = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in folder ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and Windows) do not fsync folders; the data itself was synced
    finally:
        os.close(fd)


def free_bytes(folder: str) -> int | None:
    """The bytes an unprivileged process may still write to the file system of ``folder`` (None if unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # gone, or no statvfs (Windows)
        return None
    return st.f_bavail * st.f_frsize


def write_failure(e: BaseException, folder: str) -> str | None:
    """The cause of a failed write into ``folder`` in words a user can act on; None if it is not known.

    torch's zip writer (torch.save, and DCP's shard files) reports a short write as a RuntimeError
    ("unexpected pos ..."). Some releases raise it while handling the OSError that names the cause;
    others (torch 2.14) raise it alone when writing to a path. So the OSError is used where there is
    one, and otherwise the file system is asked: a failed write into a full one was a full disk.
    Call it before the partial file is removed, or the room it took counts as free.
    """
    cause, free = os_error_in(e), free_bytes(folder)
    room = f" ({free:,} bytes free on the file system of {folder})" if free is not None else ""
    if cause is not None:
        return f"{cause}{room}" if cause.errno in _FULL else str(cause)
    if free is not None and free < FULL_BELOW:
        return f"{os.strerror(errno.ENOSPC)}{room}"
    return None


def temporary_name(path: str) -> str:
    """A fresh name beside ``path`` for a file or folder being written (unique per writer)."""
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=PART)
    os.close(fd)
    os.unlink(tmp)
    return tmp


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it is synced and renamed over ``path``.

    On any exception (KeyboardInterrupt included) the temporary file is removed and ``path`` is
    untouched. Several processes may write the same path at once: each has its own temporary
    name, and the last rename wins with a whole file.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes whole files: mode 'wb' or 'w', not {mode!r}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = temporary_name(path)
    try:
        # Opened with 0o666 less the umask, as open() would: mkstemp's 0o600 would hide a
        # checkpoint from the rest of a team that shares an output folder.
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_bytes(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_write(path) as f:
        f.write(data)


def replace_dir(tmp: str, path: str) -> None:
    """Move the finished folder ``tmp`` to ``path`` atomically; an old ``path`` goes only once ``tmp`` is in place."""
    fsync_dir(tmp)
    if os.path.exists(path):
        # rename(2) cannot replace a non-empty folder, so the old one is set aside first; between the
        # two renames ``path`` is briefly absent, which readers of checkpoints treat as "not there yet".
        aside = temporary_name(path)
        os.replace(path, aside)
        os.replace(tmp, path)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
