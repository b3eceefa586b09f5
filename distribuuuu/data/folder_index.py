"""An ImageFolder split listed into arrays (data/index.py), and kept between jobs in a cache file.

The listing is torchvision's, step for step: the class folders are the top's folders sorted by
name (``find_classes``); each class's files are ``os.walk``'s, following links, its folders and
then their files sorted, kept where the name ends in an image extension in any case
(``make_dataset``). It is written here rather than called because ImageFolder returns a list of
(path, target) tuples, and because its Python work per file (a join, a check, a tuple) took most
of its 5.1 s on ImageNet's 1.28M files; here a folder's names are joined into one string.

**The cache key** (``folder_index`` with a cache folder): the stats (mtime, ctime, inode) of every
folder of the tree, the top, the class folders and their sub-folders. A folder's mtime changes
when an entry is added to it, removed or renamed, so a changed listing is seen by stat-ing the
folders, 1,001 of them for ImageNet, without listing or stat-ing its 1.28M files (which would cost
what the scan costs); ctime catches a folder whose permissions changed, the inode one replaced.
What it does not see: a file rewritten in place under its name (the index, names and classes, is
unchanged by that: its bytes are read when the sample is), and a change within the timestamp tick
in which a folder was recorded: a folder modified less than ``RACY_NS`` before the scan began is
therefore not cached (the next job scans again), so that a later change gets a later mtime. The
file system's clock is the one that stamps mtimes: a file server whose clock lags this machine's
by more than that narrows the guard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS

from distribuuuu.data.index import Labels, Strings
from distribuuuu.data.index_file import IndexFileError, read_index_file, write_index_file

logger = logging.getLogger("distribuuuu.data")

KIND = "distribuuuu-folder-index-1"
RACY_NS = 2_000_000_000  # a folder younger than this at the scan is not cached (see above)


@dataclass(frozen=True)
class FolderIndex:
    """A split folder's class names, its samples' paths relative to it and their targets, and its
    folders (relative; "" the top) whose stats key its cache file."""

    classes: list[str]
    paths: Strings
    labels: Labels
    dirs: Strings


def scan_folder(folder: str, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> FolderIndex:
    """List ``folder`` as torchvision's ImageFolder does, into arrays."""
    classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    chunks, counts, dirs = [], [], [""]
    for name in classes:
        class_dir = os.path.join(folder, name)
        dirs.append(name)
        count = 0
        for root, subdirs, files in sorted(os.walk(class_dir, followlinks=True)):
            rel = name + root[len(class_dir) :]  # os.walk's roots start with the folder it was given
            dirs += [f"{rel}/{d}" for d in subdirs]
            names = sorted(f for f in files if f.lower().endswith(extensions))
            if names:  # every path NUL-ended: one string, encoded once, cut by numpy
                chunks.append(f"{rel}/" + f"\0{rel}/".join(names) + "\0")
                count += len(names)
        counts.append(count)
    paths = Strings.joined(os.fsencode("".join(chunks)))
    labels = Labels(np.repeat(np.arange(len(classes), dtype=np.int64), counts))
    return FolderIndex(classes, paths, labels, Strings.of(dirs))


def folder_index(folder: str, cache_dir: str = "", extensions: tuple[str, ...] = IMG_EXTENSIONS) -> FolderIndex:
    """``folder``'s index: read from ``cache_dir`` when its folders are as they were listed, else
    scanned (and written there; "": no cache)."""
    path = cache_file(cache_dir, folder, extensions) if cache_dir else ""
    cached = _load(path, folder, extensions) if path else None
    if cached is not None:
        logger.info("%s: %d samples from the index cache %s", folder, len(cached.paths), path)
        return cached
    started, clock = time.time_ns(), time.perf_counter()
    index = scan_folder(folder, extensions)
    logger.info("%s: %d samples in %d classes listed in %.1f s", folder, len(index.paths), len(index.classes),
                time.perf_counter() - clock)  # fmt: skip
    if path:
        _save(path, folder, extensions, index, started)
    return index


def cache_file(cache_dir: str, folder: str, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> str:
    """Where ``cache_dir`` keeps ``folder``'s index: a name from its real path and the extensions."""
    key = "\0".join([os.path.realpath(folder), *extensions])
    return os.path.join(cache_dir, f"folder-{hashlib.sha256(os.fsencode(key)).hexdigest()[:24]}.idx")


def dir_stats(folder: str, dirs: Strings) -> np.ndarray:
    """(mtime, ctime, inode) of each of ``dirs`` under ``folder``, following links; -1s for one that is gone."""
    stats = np.full((len(dirs), 3), -1, dtype=np.int64)
    for i, rel in enumerate(dirs):
        try:
            st = os.stat(os.path.join(folder, rel))
        except OSError:
            continue
        stats[i] = st.st_mtime_ns, st.st_ctime_ns, st.st_ino
    return stats


def _meta(folder: str, extensions: tuple[str, ...]) -> dict:
    """What a cache file says it indexes: compared whole, so another folder's file is never read as this one's."""
    return {"folder": os.path.realpath(folder), "extensions": list(extensions)}


def _save(path: str, folder: str, extensions: tuple[str, ...], index: FolderIndex, started_ns: int) -> None:
    """Write the index with its folders' stats, unless a folder changed moments before the scan."""
    stats = dir_stats(folder, index.dirs)
    fresh = np.flatnonzero(stats[:, 0] >= started_ns - RACY_NS)
    if len(fresh):
        logger.info(
            "%s: index not cached: %s changed moments before it was listed", folder, index.dirs[fresh[0]] or "."
        )
        return
    arrays = {
        "class_data": Strings.of(index.classes).data, "class_offsets": Strings.of(index.classes).offsets,
        "path_data": index.paths.data, "path_offsets": index.paths.offsets, "targets": index.labels.values,
        "dir_data": index.dirs.data, "dir_offsets": index.dirs.offsets, "dir_stats": stats,
    }  # fmt: skip
    try:
        write_index_file(path, KIND, _meta(folder, extensions), arrays)
    except OSError as e:  # a cache: the run goes on with the index it has
        logger.warning("index cache %s not written: %s", path, e)


def _load(path: str, folder: str, extensions: tuple[str, ...]) -> FolderIndex | None:
    """The cached index, or None (logged) when there is none, it is damaged or another's, or the folder changed."""
    try:
        meta, arrays = read_index_file(path, KIND)
        index = _from_arrays(path, arrays)
    except FileNotFoundError:
        return None
    except (OSError, IndexFileError) as e:
        logger.warning("%s; listing %s again", e, folder)
        return None
    if meta != _meta(folder, extensions):
        logger.warning("%s indexes %s, not %s; listing it again", path, meta.get("folder"), os.path.realpath(folder))
        return None
    changed = np.flatnonzero((dir_stats(folder, index.dirs) != arrays["dir_stats"].reshape(-1, 3)).any(axis=1))
    if len(changed):
        logger.info(
            "%s: %s changed since its index was cached; listing it again", folder, index.dirs[changed[0]] or "."
        )
        return None
    return index


def _from_arrays(path: str, arrays: dict[str, np.ndarray]) -> FolderIndex:
    """The index a cache file's arrays hold, every offset and target checked to be in range."""
    need = ("class_data", "class_offsets", "path_data", "path_offsets", "targets", "dir_data", "dir_offsets")
    if any(name not in arrays for name in (*need, "dir_stats")):
        raise IndexFileError(f"{path}: arrays missing")
    classes, paths, dirs = (Strings(arrays[f"{n}_data"], arrays[f"{n}_offsets"]) for n in ("class", "path", "dir"))
    targets = arrays["targets"]
    ok = all(_well_formed(s) for s in (classes, paths, dirs)) and len(targets) == len(paths)
    ok = ok and bool(np.all((targets >= 0) & (targets < len(classes)))) and len(arrays["dir_stats"]) == 3 * len(dirs)
    if not ok:
        raise IndexFileError(f"{path}: offsets or targets out of range")
    return FolderIndex(list(classes), paths, Labels(targets), dirs)


def _well_formed(strings: Strings) -> bool:
    """Offsets from 0 to the end of the bytes, never decreasing, and no NUL among the bytes."""
    o = strings.offsets
    return (
        len(o) >= 1 and o[0] == 0 and o[-1] == len(strings.data) and bool(np.all(np.diff(o) >= 0))
        and not bool((strings.data == 0).any())
    )  # fmt: skip
