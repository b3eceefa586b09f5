"""One WebDataset shard read by sample: a memory-mapped tar indexed by one int64 a sample.

It reads what wids's ``IndexedTarSamples`` reads (the same grouping of a tar's files into samples,
the same ``{".ext": BytesIO, "__key__": key}`` for each), without its index: wids keeps a dict and
a list of tuples of every member's name, offset and size, and a list of lists grouping them, 375
private bytes a sample in each reader once it has opened the shard (docs/design.md), and a reader
keeps every shard open. Here a sample is the offset of its first member's header, and its members
are read from their headers when the sample is (a few 512-byte blocks of the mapped file).

Grouping, as wids does it: the regular files (typeflag "0" or "") in tar order, a name without a
"." left out, consecutive files whose names share the part before the first "." of the base name
(the key) making one sample; other members (directories, pax headers) are passed over.
"""

from __future__ import annotations

import io
import mmap
import re
from typing import BinaryIO

import numpy as np

BLOCK = 512
_SPLIT = re.compile(r"^((?:.*/)?.*?)(\..*)$")  # wids's splitname: the key, and the extension from its first "."


def _member(tar: mmap.mmap, offset: int) -> tuple[str, int, int] | None:
    """The member whose header is at ``offset``: its name ("" unless a regular file), its data's
    size, the next header's offset; None at the archive's end."""
    if offset + BLOCK > len(tar):
        return None
    header = tar[offset : offset + BLOCK]
    size_field = header[124:136].rstrip(b"\0 ").strip()
    if not size_field:  # the end-of-archive blocks (and wids's test for them)
        return None
    size = int(size_field, 8)
    name = header[:100].strip(b"\0").decode("utf-8")
    regular = header[156:157] in (b"0", b"\0") and name not in ("", "././@PaxHeader")
    return (name if regular else ""), size, offset + BLOCK + -(-size // BLOCK) * BLOCK


def _sample_starts(tar: mmap.mmap) -> np.ndarray:
    """The header offset of each sample's first file."""
    starts, last_key, offset = [], None, 0
    while (member := _member(tar, offset)) is not None:
        name, _, following = member
        if "." in name:
            key = _SPLIT.match(name).group(1)
            if key != last_key:
                starts.append(offset)
                last_key = key
        offset = following
    return np.asarray(starts, dtype=np.int64)


class TarSamples:
    """A shard's samples by index, from the tar at ``path`` (or the open ``stream``), mapped read-only."""

    def __init__(self, path: str | None = None, stream: BinaryIO | None = None):
        self.stream = stream if stream is not None else open(path, "rb")
        self.path = path or getattr(self.stream, "name", "")
        try:
            self.tar = mmap.mmap(self.stream.fileno(), 0, access=mmap.ACCESS_READ)
            self.starts = _sample_starts(self.tar)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict:
        """Sample ``index``: each file's bytes under its extension (".jpg": BytesIO), and "__key__"."""
        offset, key, sample = int(self.starts[index]), None, {}
        while (member := _member(self.tar, offset)) is not None:
            name, size, following = member
            if "." in name:
                k, ext = _SPLIT.match(name).groups()
                if key is not None and k != key:
                    break
                key = k
                sample[ext] = io.BytesIO(self.tar[offset + BLOCK : offset + BLOCK + size])
            offset = following
        sample["__key__"] = key
        return sample

    def close(self) -> None:
        if getattr(self, "tar", None) is not None:
            self.tar.close()
        self.stream.close()
