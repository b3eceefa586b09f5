"""The dataset index at ImageNet size (``tools/benchmark.py --what index``): how long one rank takes
to scan a split folder, what the index holds in the rank, how much each DataLoader worker's private
memory grows over an epoch of reads, and how long N local ranks take to start on the split.

Two readers, side by side on the same folder in the same run:

- ``imagefolder``: torchvision's ``ImageFolder``, which every rank built before this branch
  (``CheckedImageFolder`` was ImageFolder with a loader): a list of (path, target) tuples per rank;
- ``index``: ``build_base_dataset`` as a run calls it (global rank 0 scans, or reads
  ``DATA.INDEX_CACHE``; the other ranks receive the arrays), and ``index_cached``, the same with the
  cache already written.

Each measurement runs in a fresh process (spawned, as a rank is), so one reader's freed memory does
not flatter the next; the DataLoader workers are forked from it, as a run's are on Linux.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

IMAGENET_TRAIN = 1_281_167  # ImageNet-1k's training images
IMAGENET_CLASSES = 1_000
MADE = ".benchmark-folder"  # a file at the split's top (no class: ImageFolder takes folders) saying what was made
MARK = -1  # the sample index that asks a worker for its private bytes
READERS = ("imagefolder", "index", "index_cached")


# ------------------------------------------------------------------------------------------------
# The folder
# ------------------------------------------------------------------------------------------------
def make_linked_folder(folder: str, entries: int = IMAGENET_TRAIN, classes: int = IMAGENET_CLASSES) -> str:
    """``folder`` filled as ImageNet's train split is named (``n00000000/n00000000_10000.JPEG``: the
    same path lengths), ``entries`` files over ``classes`` class folders, every file of a class a hard
    link of one 8x8 JPEG (no disk but the directory entries). Kept as it is when already made so."""
    made = os.path.join(folder, MADE)
    if os.path.isfile(made) and open(made).read() == f"{entries} {classes}":
        return folder
    from PIL import Image

    shutil.rmtree(folder, ignore_errors=True)
    per_class, extra = divmod(entries, classes)
    for c in range(classes):
        wnid = f"n{c:08d}"
        os.makedirs(os.path.join(folder, wnid))
        first = os.path.join(folder, wnid, f"{wnid}_10000.JPEG")
        Image.new("RGB", (8, 8), (c % 256, c // 256 % 256, 128)).save(first, quality=90)
        for k in range(1, per_class + (c < extra)):
            os.link(first, os.path.join(folder, wnid, f"{wnid}_{10000 + k}.JPEG"))
    with open(made, "w") as f:
        f.write(f"{entries} {classes}")
    return folder


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------
def private_bytes(pid: int | str = "self") -> int:
    """A process's unique set size: its private pages, clean and dirty (``/proc/PID/smaps_rollup``).
    A page a forked worker shares copy-on-write with its rank counts once the worker writes to it."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def retained_bytes(build: Callable[[], Any]) -> tuple[Any, int]:
    """``build()``'s result and the bytes of the allocations it leaves behind (tracemalloc, which
    traces Python's objects and numpy's array data alike; measured after a full collection)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = build()
        gc.collect()
        return result, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def path_bytes(samples: Sequence) -> int:
    """The bytes of every sample's path, as the file system names it."""
    return sum(len(os.fsencode(path)) for path, _ in samples)


class IndexReads:
    """Sample i's entry read as a reader's ``__getitem__`` reads it (``samples[i]``: its path and target),
    without opening the file; index ``MARK`` answers (pid, private bytes) of the worker reading it."""

    def __init__(self, samples: Sequence):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        if index == MARK:
            return os.getpid(), private_bytes()
        path, target = self.samples[index]
        return None


def _readings(batch: list) -> list:
    return [item for item in batch if item is not None]


class _Epoch:
    """The batches of an epoch of ``count`` samples in a seeded random order, between ``workers``
    marks before and after (batches go to the workers in turn: a run of marks reaches each once).

    Drawn as the batches are asked for, after the workers are forked, as a training sampler draws
    its permutation: batches made before the fork would be pages the workers share, and the rank
    writing their reference counts as it sends them would make them the workers' own (32 B a
    sample of the worker's private memory that the worker never touched)."""

    def __init__(self, count: int, workers: int, batch: int):
        self.count, self.workers, self.batch = count, workers, batch

    def __iter__(self):
        yield from [[MARK]] * self.workers
        order = np.random.default_rng(0).permutation(self.count)
        for start in range(0, self.count, self.batch):
            yield order[start : start + self.batch].tolist()
        yield from [[MARK]] * self.workers


def worker_growth(samples: Sequence, count: int | None = None, workers: int = 1, batch: int = 4096) -> list[int]:
    """Each DataLoader worker's private-memory growth in bytes over an epoch of reads of the first
    ``count`` samples (all by default) in a seeded random order, as a training sampler draws them:
    from its first batch, which asks its size, to its last, which asks again."""
    import torch

    count = len(samples) if count is None else count
    loader = torch.utils.data.DataLoader(
        IndexReads(samples), batch_sampler=_Epoch(count, workers, batch), num_workers=workers, collate_fn=_readings,
        multiprocessing_context="fork",
    )  # fmt: skip
    sizes: dict[int, list[int]] = {}
    for readings in loader:
        for pid, size in readings:
            sizes.setdefault(pid, []).append(size)
    return [after - before for before, after in sizes.values()]


# ------------------------------------------------------------------------------------------------
# The readers
# ------------------------------------------------------------------------------------------------
def build(reader: str, folder: str, cache: str = "", decide: Callable | None = None):
    """The split ``folder`` as ``reader`` reads it: torchvision's ImageFolder, or build_base_dataset."""
    if reader == "imagefolder":
        import torchvision

        return torchvision.datasets.ImageFolder(folder, allow_empty=True)
    from distribuuuu.data.readers import build_base_dataset

    root, split = os.path.split(os.path.abspath(folder))
    kwargs = {"decide": decide} if decide is not None else {}
    return build_base_dataset(root, split, index_cache=cache, **kwargs)[0]


def _import_readers() -> None:
    """Import what the readers need, so that neither a listing's time nor its bytes count the imports."""
    import torchvision  # noqa: F401

    import distribuuuu.data.readers  # noqa: F401  (build's own module: every reader it may ask)


def _one_rank(reader: str, folder: str, cache: str, workers: int, out) -> None:
    """One fresh process: the scan's time, the rank's growth, each worker's growth over an epoch."""
    _import_readers()
    gc.collect()
    before = private_bytes()
    start = time.perf_counter()
    dataset = build(reader, folder, cache)
    seconds = time.perf_counter() - start
    gc.collect()
    grown = private_bytes() - before
    out.put({"scan_s": seconds, "rank_uss_bytes": grown, "worker_bytes": worker_growth(dataset.samples, None, workers)})


def _retained(reader: str, folder: str, cache: str, out) -> None:
    """One fresh process: what the index retains (tracemalloc) against its paths' own bytes."""
    _import_readers()
    dataset, retained = retained_bytes(lambda: build(reader, folder, cache))
    out.put({"index_bytes": retained, "path_bytes": path_bytes(dataset.samples), "samples": len(dataset.samples)})


def _in_fresh_process(target: Callable, *args) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=target, args=(*args, out))
    process.start()
    result = out.get()
    process.join()
    return result


# ------------------------------------------------------------------------------------------------
# N local ranks
# ------------------------------------------------------------------------------------------------
def _rank_main(rank: int, ranks: int, port: int, reader: str, folder: str, cache: str, result: str) -> None:
    """One rank of a local gloo group: wait for all, build the split, wait for all; rank 0 writes the time."""
    import datetime

    import torch.distributed as dist

    from distribuuuu.runtime.process_group import rank0_decides

    _import_readers()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, ranks, rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    try:
        dist.barrier()
        start = time.perf_counter()
        build(reader, folder, cache, rank0_decides)
        dist.barrier()
        if rank == 0:
            with open(result, "w") as f:
                f.write(str(time.perf_counter() - start))
    finally:
        dist.destroy_process_group()


def ranks_startup(reader: str, folder: str, ranks: int, cache: str = "") -> float:
    """Seconds from the moment ``ranks`` local ranks are all up to the moment each has the split."""
    import torch.multiprocessing as mp

    from distribuuuu.runtime.launcher import find_free_port

    with tempfile.NamedTemporaryFile("r", suffix=".s") as result:
        mp.start_processes(
            _rank_main, (ranks, find_free_port(), reader, folder, cache, result.name), ranks, start_method="spawn"
        )
        return float(result.read())


# ------------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------------
def measure(
    emit: Callable[[dict], None], folder: str = "", entries: int = IMAGENET_TRAIN, ranks: Sequence[int] = (2, 4),
    repeats: int = 3, workers: int = 2,
) -> list[dict]:  # fmt: skip
    """Every figure of both readers on ``folder`` (made with ``entries`` hard links when ""): one
    record per reader and one per reader and rank count, each passed to ``emit``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    scratch = tempfile.mkdtemp(prefix="benchmark-index-")
    try:
        folder = folder or make_linked_folder(os.path.join(scratch, "train"), entries)
        cache = os.path.join(scratch, "index-cache")
        build("imagefolder", folder)  # the directory entries in the page cache, for every reader alike
        _write_cache(folder, cache)
        records = _per_reader(folder, cache, repeats, workers) + _per_rank_count(folder, cache, ranks, repeats)
        for record in records:
            emit(record)
        return records
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_cache(folder: str, cache: str) -> None:
    """Write the index cache that ``index_cached`` reads, once the folder is old enough to be cached."""
    from distribuuuu.data.folder_index import RACY_NS

    newest = max(os.stat(folder).st_mtime_ns, *(e.stat().st_mtime_ns for e in os.scandir(folder) if e.is_dir()))
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9 + 0.5))
    build("index", folder, cache)
    if not os.path.isdir(cache) or not os.listdir(cache):
        raise RuntimeError(f"{folder}: its index was not cached (a folder changed while it was listed?)")


def _per_reader(folder: str, cache: str, repeats: int, workers: int) -> list[dict]:
    """Scan time (median of ``repeats`` fresh processes, readers in turn), bytes in the rank and in each worker."""
    runs: dict[str, list[dict]] = {reader: [] for reader in READERS}
    for _ in range(repeats):
        for reader in READERS:
            runs[reader].append(_in_fresh_process(_one_rank, reader, folder, _cache_of(reader, cache), workers))
    records = []
    for reader, measured in runs.items():
        held = _in_fresh_process(_retained, reader, folder, _cache_of(reader, cache))
        growth = [max(run["worker_bytes"]) for run in measured]
        records.append({
            "what": "index", "reader": reader, "samples": held["samples"], "repeats": repeats, "workers": workers,
            "scan_s_median": statistics.median(run["scan_s"] for run in measured),
            "scan_s_min": min(run["scan_s"] for run in measured), "scan_s_max": max(run["scan_s"] for run in measured),
            "index_bytes": held["index_bytes"], "path_bytes": held["path_bytes"],
            "index_bytes_per_sample": held["index_bytes"] / held["samples"],
            "rank_uss_bytes_median": statistics.median(run["rank_uss_bytes"] for run in measured),
            "worker_growth_bytes_median": statistics.median(growth),
            "worker_growth_per_sample": statistics.median(growth) / held["samples"],
        })  # fmt: skip
    return records


def _per_rank_count(folder: str, cache: str, ranks: Sequence[int], repeats: int) -> list[dict]:
    """The start-up of N local ranks on the split (median of ``repeats``), per reader."""
    records = []
    for n in ranks:
        for reader in READERS:
            times = [ranks_startup(reader, folder, n, _cache_of(reader, cache)) for _ in range(repeats)]
            records.append({
                "what": "index_ranks", "reader": reader, "ranks": n, "repeats": repeats,
                "startup_s_median": statistics.median(times), "startup_s_min": min(times), "startup_s_max": max(times),
            })  # fmt: skip
    return records


def _cache_of(reader: str, cache: str) -> str:
    """DATA.INDEX_CACHE for ``reader``: the cache folder for index_cached, none for the others."""
    return cache if reader == "index_cached" else ""


def table(records: list[dict]) -> str:
    """The records as the lines of docs/performance.md's table."""
    scans = {r["reader"]: r for r in records if r["what"] == "index"}
    lines = []
    for r in scans.values():
        lines.append(
            f"index {r['reader']:<13} {r['samples']:,} samples  scan {r['scan_s_median']:.2f} s "
            f"({r['scan_s_min']:.2f}-{r['scan_s_max']:.2f})  rank {r['index_bytes_per_sample']:.1f} B/sample "
            f"(paths {r['path_bytes'] / r['samples']:.1f})  worker +{r['worker_growth_per_sample']:.1f} B/sample"
        )
    for r in records:
        if r["what"] == "index_ranks":
            one = scans.get("imagefolder", {}).get("scan_s_median", float("nan"))
            lines.append(
                f"index {r['reader']:<13} {r['ranks']} ranks start in {r['startup_s_median']:.2f} s "
                f"({r['startup_s_min']:.2f}-{r['startup_s_max']:.2f}) = {r['startup_s_median'] / one:.2f} x one "
                "rank's ImageFolder scan"
            )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m benchmarks.index [FOLDER]: the stage alone, JSON lines then the table
    found = measure(lambda r: print(json.dumps(r), flush=True), sys.argv[1] if len(sys.argv) > 1 else "")
    print(table(found))
