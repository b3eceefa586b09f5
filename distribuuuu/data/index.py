"""A dataset's sample list held in arrays: paths as one bytes buffer and int64 offsets, targets as
int64 class indices (a multi-label sample's as a run of them), so the index is a few bytes a sample.

Why not a list of (path, target) tuples, as ImageFolder keeps: each tuple, string and large int is a
Python object of its own (191 B a sample at ImageNet size, where the path itself is 70), and reading
one writes its reference count, so a DataLoader worker forked from the rank copies every page of
the list it reads (PyTorch issue 13246; 226 B a sample, per worker, over an epoch). A handful of
numpy arrays are a handful of objects: the worker reads their pages and copies none.

``Samples``, ``Labels`` and ``Strings`` are sequences shaped like the lists they replace
(``dataset.samples[i]`` is ``(path, target)`` with a Python int or tuple, ``dataset.targets[i]`` an
int), and compare equal to them, so the code that reads ``samples`` and ``targets`` keeps working.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

Target = int | tuple[int, ...]  # a class index, or the sorted class indices of a multi-label sample


class _Column(Sequence):
    """A sequence over arrays: slices are lists (as a list's are), equality is element by element."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.item(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} entries")
        return self.item(index % len(self))

    @abstractmethod
    def item(self, index: int):
        """Entry ``index`` (0 <= index < len)."""

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # mutable-looking, like the list it stands for

    def __repr__(self) -> str:
        shown = ", ".join(repr(x) for x in self[:3])
        return f"{type(self).__name__}([{shown}{', ...' if len(self) > 3 else ''}] of {len(self)})"


def _ragged(values: np.ndarray, offsets: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs ``indices`` of a ragged array (``values`` cut at ``offsets``), as a new ragged array."""
    starts, ends = offsets[indices], offsets[indices + 1]
    lengths = ends - starts
    new_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    # each kept value's position in ``values``: its run's start plus its place in the run
    within = np.arange(int(new_offsets[-1]), dtype=np.int64) - np.repeat(new_offsets[:-1], lengths)
    return values[np.repeat(starts, lengths) + within], new_offsets


class Strings(_Column):
    """Strings kept as the bytes the file system names them by, in one buffer cut at ``offsets``;
    decoded as ``os.fsdecode`` does, so a name that is not UTF-8 comes back as Python named it."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    @classmethod
    def of(cls, strings: Iterable[str]) -> Strings:
        """The strings of ``strings``, in order."""
        encoded = [os.fsencode(s) for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    @classmethod
    def joined(cls, data: bytes) -> Strings:
        """The strings of ``data``, each ended by a NUL byte (which no file name holds)."""
        raw = np.frombuffer(data, dtype=np.uint8)
        ends = np.flatnonzero(raw == 0)
        offsets = np.zeros(len(ends) + 1, dtype=np.int64)
        offsets[1:] = ends - np.arange(len(ends))  # each end less the NULs before it
        return cls(raw[raw != 0], offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def item(self, index: int) -> str:
        return os.fsdecode(self.data[self.offsets[index] : self.offsets[index + 1]].tobytes())

    def take(self, indices: np.ndarray) -> Strings:
        """The strings at ``indices``, in that order."""
        data, offsets = _ragged(self.data, self.offsets, indices)
        return Strings(data, offsets)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.offsets.nbytes


class Labels(_Column):
    """Each sample's target: a class index, or with ``offsets`` the sorted class indices of a
    multi-label sample (``values`` cut at ``offsets``; an empty run is a negative sample)."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray | None = None):
        self.values, self.offsets = values, offsets

    @classmethod
    def of(cls, targets: Sequence[Target], multilabel: bool = False) -> Labels:
        """The targets of ``targets``: ints, or tuples of ints when ``multilabel``."""
        if not multilabel:
            return cls(np.asarray(targets, dtype=np.int64).reshape(-1))
        offsets = np.zeros(len(targets) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in targets], out=offsets[1:])
        return cls(np.fromiter((i for t in targets for i in t), dtype=np.int64, count=int(offsets[-1])), offsets)

    @property
    def multilabel(self) -> bool:
        return self.offsets is not None

    def __len__(self) -> int:
        return len(self.values) if self.offsets is None else len(self.offsets) - 1

    def item(self, index: int) -> Target:
        if self.offsets is None:
            return int(self.values[index])
        return tuple(self.values[self.offsets[index] : self.offsets[index + 1]].tolist())

    def __iter__(self) -> Iterator[Target]:
        if self.offsets is None:
            return iter(self.values.tolist())
        return (self.item(i) for i in range(len(self)))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The class indices as an array (what np.asarray, np.bincount and torch.as_tensor read)."""
        if self.offsets is not None:
            raise TypeError("multi-label targets are runs of class indices, not one array")
        return self.values if dtype is None else self.values.astype(dtype, copy=False)

    def take(self, indices: np.ndarray) -> Labels:
        """The targets at ``indices``, in that order."""
        if self.offsets is None:
            return Labels(self.values[indices])
        return Labels(*_ragged(self.values, self.offsets, indices))

    def mapped(self, mapping: Mapping[int, int]) -> tuple[Labels, np.ndarray]:
        """The targets through ``mapping`` and the indices of the samples kept: a class index
        ``mapping`` lacks drops its sample; a multi-label sample keeps the indices it maps (and the
        sample, even with none left: a negative, as before)."""
        table = np.full(int(max(self.values.max(initial=-1), max(mapping, default=-1))) + 1, -1, dtype=np.int64)
        table[list(mapping)] = list(mapping.values())
        new = table[self.values]
        if self.offsets is None:
            keep = np.flatnonzero(new >= 0)
            return Labels(new[keep]), keep
        runs = np.repeat(np.arange(len(self)), np.diff(self.offsets))[new >= 0]
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(np.bincount(runs, minlength=len(self)), out=offsets[1:])
        values = new[new >= 0]
        # each run sorted again: a mapping may reorder a sample's classes
        return Labels(values[np.lexsort((values, runs))], offsets), np.arange(len(self))

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


class Samples(_Column):
    """(path, target) of each sample, as ImageFolder's ``samples`` list holds them: ``paths`` joined
    to ``prefix`` (ImageFolder's folder; "" when the paths are whole), ``labels`` the targets. ``rows``
    (a reader's own numbering of its samples, such as a row of its shards) follow the samples a
    class remapping keeps."""

    def __init__(self, paths: Strings, labels: Labels, prefix: str = "", rows: np.ndarray | None = None):
        if len(paths) != len(labels) or (rows is not None and len(rows) != len(paths)):
            raise ValueError(f"{len(paths)} paths and {len(labels)} targets (rows: {rows is not None})")
        self.paths, self.labels, self.prefix, self.rows = paths, labels, prefix, rows

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        """Sample ``index``'s path."""
        return os.path.join(self.prefix, self.paths[index]) if self.prefix else self.paths[index]

    def row(self, index: int) -> int:
        """Sample ``index``'s row in its reader (its index when the reader has no rows of its own)."""
        return index if self.rows is None else int(self.rows[index])

    def all_rows(self) -> np.ndarray:
        """Every sample's row (Samples.row), in order."""
        return np.arange(len(self), dtype=np.int64) if self.rows is None else self.rows

    def item(self, index: int) -> tuple[str, Target]:
        return self.path(index), self.labels.item(index)

    def __iter__(self) -> Iterator[tuple[str, Target]]:
        return (self.item(i) for i in range(len(self)))

    def take(self, indices: np.ndarray) -> Samples:
        """The samples at ``indices``, in that order."""
        return Samples(self.paths.take(indices), self.labels.take(indices), self.prefix, self.all_rows()[indices])

    def mapped(self, mapping: Mapping[int, int]) -> Samples:
        """The samples with their targets through ``mapping`` (Labels.mapped: those it cannot map dropped)."""
        labels, keep = self.labels.mapped(mapping)
        kept = self if len(keep) == len(self) else self.take(keep)
        return Samples(kept.paths, labels, self.prefix, kept.rows)

    @property
    def nbytes(self) -> int:
        return self.paths.nbytes + self.labels.nbytes + (0 if self.rows is None else self.rows.nbytes)
