"""The index cache file: named numpy arrays behind a checked header, read back without pickle.

Layout: ``MAGIC`` (8 bytes), the header's length (8 bytes, little-endian), the header (JSON: the
file's kind, what it describes, each array's name, dtype and length, and a CRC-32 of the arrays'
bytes), then each array's bytes in the header's order, every one starting at a multiple of 8.

The file is the user's disk, so it is read as hostile: a size is believed only once the header's
sizes add up to the file's own, before anything is allocated from them; the dtypes are an
allow-list; the bytes must match their CRC. Any failure is an ``IndexFileError`` naming why, and the
caller rebuilds rather than trusts. (``np.load`` of an ``.npz`` would allocate each array's
declared shape before finding the file short, and one ``.npy`` a member cannot be replaced
atomically as one file.) Written through ``files.atomic_write``: a crash leaves the old file or
the new, never half of one.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

from distribuuuu.files import atomic_write

MAGIC = b"DSTBIDX1"
MAX_HEADER = 1 << 20  # a header is a few hundred bytes of JSON; more is no file of ours
DTYPES = ("<i8", "|u1")  # int64 offsets, targets and stats; the bytes of names
ALIGN = 8


class IndexFileError(ValueError):
    """A cache file that is not one of ours, is damaged, or describes something else."""


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_index_file(path: str, kind: str, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` (int64 or uint8, any shape, flattened) with ``kind`` and ``meta`` to ``path``, atomically."""
    flat = {name: np.ascontiguousarray(a).reshape(-1) for name, a in arrays.items()}
    for name, a in flat.items():
        if a.dtype.str not in DTYPES:
            raise ValueError(f"{name}: dtype {a.dtype.str} is not one of {DTYPES}")
    crc = 0
    for a in flat.values():
        crc = zlib.crc32(a.data, crc)
    header = json.dumps(
        {"kind": kind, "meta": meta, "arrays": [[n, a.dtype.str, len(a)] for n, a in flat.items()], "crc32": crc}
    ).encode()
    with atomic_write(path) as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        f.write(b"\0" * (_padded(f.tell()) - f.tell()))
        for a in flat.values():
            f.write(a.data)
            f.write(b"\0" * (_padded(a.nbytes) - a.nbytes))


def read_index_file(path: str, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The meta and the (read-only) arrays of a file ``write_index_file`` wrote with ``kind``; an
    IndexFileError naming what is wrong with any other file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
            raise IndexFileError(f"{path}: not an index file (no {MAGIC!r} at its start)")
        length = int.from_bytes(start[len(MAGIC) :], "little")
        if length > min(MAX_HEADER, size - len(start)):
            raise IndexFileError(f"{path}: a header of {length} bytes in a file of {size}")
        header = _header(path, f.read(length), kind)
        f.seek(_padded(len(start) + length))
        layout = [(name, np.dtype(dtype), count) for name, dtype, count in header["arrays"]]
        body = sum(_padded(count * dtype.itemsize) for _, dtype, count in layout)
        if _padded(len(start) + length) + body != size:
            raise IndexFileError(f"{path}: its header describes {body} bytes of arrays, the file holds another size")
        data = f.read(body)  # at most the file's size, which is now known to be the header's sum
    crc = 0
    for view in _views(data, layout):
        crc = zlib.crc32(view, crc)
    if crc != header["crc32"]:
        raise IndexFileError(f"{path}: damaged (its arrays do not match their CRC-32)")
    return header["meta"], dict(zip((name for name, _, _ in layout), _arrays(data, layout)))


def _header(path: str, raw: bytes, kind: str) -> dict:
    """The parsed header, every field of the type it must have."""
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise IndexFileError(f"{path}: unreadable header: {e}") from None
    arrays = header.get("arrays") if isinstance(header, dict) else None
    ok = (
        isinstance(arrays, list)
        and all(
            isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and a[1] in DTYPES
            and type(a[2]) is int and a[2] >= 0
            for a in arrays
        )
        and isinstance(header.get("meta"), dict)
        and type(header.get("crc32")) is int
    )  # fmt: skip
    if not ok:
        raise IndexFileError(f"{path}: a header without the fields an index file has")
    if header.get("kind") != kind:
        raise IndexFileError(f"{path}: an index of kind {header.get('kind')!r}, not {kind!r}")
    return header


def _views(data: bytes, layout: list) -> list[memoryview]:
    """Each array's bytes in ``data`` (without the padding)."""
    views, at = [], 0
    for _, dtype, count in layout:
        views.append(memoryview(data)[at : at + count * dtype.itemsize])
        at += _padded(count * dtype.itemsize)
    return views


def _arrays(data: bytes, layout: list) -> list[np.ndarray]:
    return [np.frombuffer(view, dtype=dtype) for view, (_, dtype, _) in zip(_views(data, layout), layout)]
