"""A bounded node-local cache of a packed training split read from a URL (DATA.SHARD_CACHE_LIMIT).

Under DATA.SHUFFLE_WINDOW W the epoch reads the shards in an order known in advance (data/
samplers.py: the shards shuffled by (seed, epoch), then read W at a time), so a node needs only a
few shards at once. This cache keeps at most DATA.SHARD_CACHE_LIMIT bytes of the split's shards
in DATA.SHARD_CACHE (one folder per node, shared by its ranks and their DataLoader workers):

- **The order.** ``ShardOrder`` is the sampler's order at shard granularity, computed from
  (seed, epoch, W) by the sampler's own ``shuffled_shards``; each rank's main process records how
  far its loader is (``ProgressReporter``, called by the sampler as it hands out keys): a global
  position of the epoch before which every sample is read. The position is the sampler's, less
  the batches the loader may still have in flight (TRAIN.WORKERS x TRAIN.PREFETCH_FACTOR), so it
  never runs ahead of a worker's read.
- **One download a shard per node.** A shard is fetched under an exclusive ``fcntl.flock`` of
  its own lock file: a second rank or worker waits for the first one's download and opens the
  same file. Readers open shards under that lock too (``open``), and an eviction takes it without
  waiting, so a shard cannot vanish between the check and the open. wids maps the open file:
  removing it afterwards is safe on Linux (its blocks stay until unmapped).
- **Eviction.** Belady's rule on the known order: to make room for a shard, evict the shards
  whose next read (by the node's earliest rank: the rest of its epoch, else the next epoch) comes
  after that shard's, the last one first. Shards every rank has read past are next read in the
  next epoch, so they go first; a shard read sooner than the one being fetched is never evicted
  for it. A download that finds no room waits for the readers to move on; after
  ``ROOM_TIMEOUT_S`` it stops with one line naming DATA.SHARD_CACHE_LIMIT (never a hang).
- **Prefetch.** Local rank 0's main process runs one thread that downloads, in order, the shards
  of the slowest rank's window and the next one, plus DATA.SHARD_PREFETCH more, while they fit.

Bytes are accounted under a folder-wide lock: every shard of the split on disk counts its size,
and every download in flight counts the size the index gives (a reservation file, removed after;
one left by a killed process is dropped once no one holds its shard's lock). The counted bytes
never exceed the limit; the only excess on disk is a shard evicted while a worker still maps it
(wids keeps ``lru_size`` shards open per worker; the ranks of a node read the same few).

Written here rather than taken from LitData or MosaicML Streaming, which have such caches: both
tie their cache to their own iteration order (chunks assigned to ranks and workers by the
library), while distribuuuu's samplers decide the order (exactly once, the same on any world
size, resumable at a global position: docs/design.md), and wids, which reads our shards, has
an unbounded cache that downloads with ``curl`` and never evicts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from distribuuuu.data.errors import DataError
from distribuuuu.data.samplers import shuffled_shards

logger = logging.getLogger(__name__)

LOCKS = ".locks"  # per-shard lock files and the folder's lock, inside the cache folder
ROOM_TIMEOUT_S = 300.0  # a reader waits this long for room before naming the limit
POLL_S = 0.05
IDLE_S = 30.0  # the prefetch thread stops after this long without progress (restarted on the next)


class ShardCacheError(DataError):
    """The cache cannot hold what the loaders need; the message names DATA.SHARD_CACHE_LIMIT."""


@contextlib.contextmanager
def flocked(path: str, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` of ``path`` (created if absent); yields False if ``blocking`` is off and it is taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def shard_lock(folder: str, name: str) -> str:
    """The lock file of shard file ``name`` in cache folder ``folder``."""
    os.makedirs(os.path.join(folder, LOCKS), exist_ok=True)
    return os.path.join(folder, LOCKS, name)


def fetch_once(folder: str, path: str, is_ready: Callable[[], bool], download: Callable[[], None]) -> None:
    """Download ``path`` unless ready, one process of the node at a time: the others wait, then find it ready."""
    if is_ready():
        return
    with flocked(shard_lock(folder, os.path.basename(path))):
        if not is_ready():
            download()


class ShardOrder:
    """The order in which DATA.SHUFFLE_WINDOW reads the shards of each epoch (ShardWindowSampler's)."""

    def __init__(self, shard_samples: list[int], seed: int, window: int):
        if window < 1:
            raise ValueError(f"a bounded shard cache needs a shard window >= 1, got {window}")
        self.samples, self.seed, self.window = np.asarray(shard_samples, dtype=np.int64), seed, window
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @property
    def num_shards(self) -> int:
        return len(self.samples)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shards in order, each shard's place in it, the global position where each window ends)."""
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(self.seed + epoch)  # the sampler's generator: its first draw
            order = shuffled_shards(self.num_shards, g).numpy()
            place = np.empty_like(order)
            place[order] = np.arange(len(order))
            sizes = self.samples[order]
            window_ends = np.cumsum(sizes)[self.window - 1 :: self.window]
            if len(order) % self.window:
                window_ends = np.append(window_ends, sizes.sum())
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}  # keep a few
            self._epochs[epoch] = order, place, window_ends
        return self._epochs[epoch]

    def shards(self, epoch: int) -> np.ndarray:
        return self._epoch(epoch)[0]

    def window_at(self, epoch: int, position: int) -> int:
        """The window that global position ``position`` of the epoch reads (the number of windows at the end)."""
        return int(np.searchsorted(self._epoch(epoch)[2], position, side="right"))

    def next_use(self, shard: int, epoch: int, position: int) -> int:
        """When a rank at ``position`` of ``epoch`` next reads ``shard``: epoch x shards + its place in that epoch's order."""
        place = int(self._epoch(epoch)[1][shard])
        if place // self.window >= self.window_at(epoch, position):
            return epoch * self.num_shards + place
        return (epoch + 1) * self.num_shards + int(self._epoch(epoch + 1)[1][shard])

    def ahead(self, epoch: int, position: int, count: int) -> list[int]:
        """The ``count`` shards in the order from the window of ``position`` on (into the next epoch)."""
        start = self.window_at(epoch, position) * self.window
        ahead = list(self.shards(epoch)[start:])
        if len(ahead) < count:
            ahead += list(self.shards(epoch + 1))
        return [int(s) for s in ahead[:count]]


def min_limit(shard_bytes: list[int], order: ShardOrder, in_flight: int) -> int:
    """The bytes a bounded cache needs: the largest shards of as many windows as ``in_flight``
    consecutive positions of the order may touch (the node's reads lie between the earliest
    unread batch and the latest dispatched one): a smaller cache could wait for room that only
    the reads it blocks would free."""
    window_samples = max(1, int(order.samples.min()) * order.window)
    windows = 1 + -(-in_flight // window_samples)
    return int(np.sort(shard_bytes)[::-1][: windows * order.window].sum())


@dataclass
class ShardFile:
    url: str
    path: str  # where the cache keeps it
    size: int
    md5: str


Progress = tuple[int, int]  # (epoch, global position before which the rank has read everything)


class ShardCache:
    """The bounded cache of one split's shards in one node's folder (see the module's docstring)."""

    def __init__(
        self,
        folder: str,
        shards: list[ShardFile],
        download: Callable[[str, str, int, str], None],
        limit: int,
        prefetch: int,
        order: ShardOrder,
        in_flight: int,
        local_rank: int = 0,
        local_world_size: int = 1,
    ):
        if len(shards) != order.num_shards:
            raise ValueError(f"{len(shards)} shards, an order of {order.num_shards}")
        self.folder, self.shards, self.download, self.order = folder, shards, download, order
        self.limit, self.prefetch, self.in_flight = limit, prefetch, in_flight
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.check_limit()
        os.makedirs(os.path.join(folder, LOCKS), exist_ok=True)
        self._folder_lock = os.path.join(folder, LOCKS, "cache")
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def __getstate__(self) -> dict:
        # Workers get a copy (pickled under the spawn start method): they read, they never prefetch.
        return {**self.__dict__, "_thread": None, "_wake": None}

    def check_limit(self) -> None:
        """Refuse a limit that cannot hold what the loaders may read at once (see ``min_limit``)."""
        need = min_limit([s.size for s in self.shards], self.order, self.in_flight)
        if self.limit < need:
            raise ShardCacheError(
                f"DATA.SHARD_CACHE_LIMIT {self.limit} bytes cannot hold the shards the loaders may read at once "
                f"({self.in_flight} samples in flight on the ranks, windows of DATA.SHUFFLE_WINDOW "
                f"{self.order.window} shards of {self.shards[0].url.rsplit('/', 2)[0]}): raise it to at least "
                f"{need} or set it to 0 (unbounded)"
            )

    # -- readers: any process of the node ------------------------------------------------------

    def open(self, shard: int):
        """Shard ``shard``'s file, open for reading: downloaded first (once per node) if absent."""
        with flocked(self._lock_of(shard)):
            if not os.path.exists(self.shards[shard].path):
                self._download(shard, wait=True)
            return open(self.shards[shard].path, "rb")

    def _download(self, shard: int, wait: bool) -> bool:
        """Make room and download ``shard`` (its lock held); False if ``wait`` is off and there is no room."""
        deadline = time.monotonic() + ROOM_TIMEOUT_S
        while not self._reserve(shard):
            if not wait:
                return False
            if time.monotonic() > deadline:
                raise ShardCacheError(
                    f"DATA.SHARD_CACHE_LIMIT {self.limit} bytes: no room for {self.shards[shard].url} after "
                    f"{ROOM_TIMEOUT_S:.0f} s, the shards the loaders read at once fill it (TRAIN.WORKERS x "
                    "TRAIN.PREFETCH_FACTOR batches span more than two windows?): raise it"
                )
            time.sleep(POLL_S)
        desc = self.shards[shard]
        try:
            self.download(desc.url, desc.path, desc.size, desc.md5)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._reservation(shard))
        return True

    def _reserve(self, shard: int) -> bool:
        """Under the folder lock: evict what is done until ``shard`` fits, then count it as on disk."""
        with flocked(self._folder_lock):
            progress = self._read_progress()
            used = sum(self.shards[s].size for s in self._counted())
            need = self.shards[shard].size
            if used + need > self.limit and progress:
                soon = self._next_use(shard, progress)
                for victim in self._evictable(progress, later_than=soon):
                    used -= self._evict(victim)
                    if used + need <= self.limit:
                        break
            if used + need > self.limit:
                return False
            with open(self._reservation(shard), "w"):
                pass
            return True

    def _counted(self) -> list[int]:
        """The shards whose bytes count: on disk, or being downloaded (a reservation whose lock is held)."""
        counted = []
        for s, desc in enumerate(self.shards):
            if os.path.exists(desc.path):
                counted.append(s)
            elif os.path.exists(self._reservation(s)):
                with flocked(self._lock_of(s), blocking=False) as free:
                    if not free or os.path.exists(desc.path):  # downloading, or done since the look above
                        counted.append(s)
                    else:  # its downloader is gone (killed): nothing is being written
                        with contextlib.suppress(FileNotFoundError):  # another reader's look removed it
                            os.unlink(self._reservation(s))
        return counted

    def _evictable(self, progress: list[Progress], later_than: int) -> list[int]:
        """Shards on disk that no rank reads before ``later_than``, the one read last first (Belady)."""
        uses = [(self._next_use(s, progress), s) for s, desc in enumerate(self.shards) if os.path.exists(desc.path)]
        return [s for use, s in sorted(uses, reverse=True) if use > later_than]

    def _evict(self, shard: int) -> int:
        """Remove ``shard`` unless a process holds its lock (opening or downloading it): the bytes freed."""
        with flocked(self._lock_of(shard), blocking=False) as free:
            if not free:
                return 0
            os.unlink(self.shards[shard].path)
            return self.shards[shard].size

    def _next_use(self, shard: int, progress: list[Progress]) -> int:
        return min(self.order.next_use(shard, e, p) for e, p in progress)

    # -- progress: each rank's main process ---------------------------------------------------

    def _progress_file(self, local_rank: int) -> str:
        return os.path.join(self.folder, LOCKS, f"progress-{local_rank}")

    def _read_progress(self) -> list[Progress]:
        """Every local rank's progress (the folder lock held), or [] while a rank has not reported yet."""
        progress = []
        for r in range(self.local_world_size):
            try:
                with open(self._progress_file(r)) as f:
                    epoch, position = f.read().split()
            except (OSError, ValueError):
                return []
            progress.append((int(epoch), int(position)))
        return progress

    def report(self, epoch: int, position: int) -> None:
        """Record that this rank has read every sample of ``epoch`` before global ``position``."""
        # Transient state, rewritten every batch and meaningless after the run: written in place
        # under the folder lock (readers take it too), not through files.py's durable writer.
        with flocked(self._folder_lock), open(self._progress_file(self.local_rank), "w") as f:
            f.write(f"{epoch} {position}\n")
        if self.local_rank == 0:
            self._wake.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
                self._thread.start()

    # -- prefetch: local rank 0's main process ---------------------------------------------------

    def _prefetch_loop(self) -> None:
        failed: set[int] = set()  # left to the reader that needs it, which names the error
        while self._wake.wait(IDLE_S):
            self._wake.clear()
            for shard in self._horizon():
                if shard in failed:
                    break
                if os.path.exists(self.shards[shard].path):
                    continue
                try:
                    with flocked(self._lock_of(shard)):
                        if not os.path.exists(self.shards[shard].path) and not self._download(shard, wait=False):
                            break  # no room yet: try again on the next progress
                except Exception as e:  # noqa: BLE001 - the thread must not die on a bad shard
                    logger.debug("prefetch of %s failed: %s", self.shards[shard].url, e)
                    failed.add(shard)
                    break

    def _horizon(self) -> list[int]:
        """The slowest rank's window and the next, then DATA.SHARD_PREFETCH more shards, in order."""
        with flocked(self._folder_lock):
            progress = self._read_progress()
        if not progress:
            return []
        epoch, position = min(progress)
        return self.order.ahead(epoch, position, 2 * self.order.window + self.prefetch)

    def _lock_of(self, shard: int) -> str:
        return shard_lock(self.folder, os.path.basename(self.shards[shard].path))

    def _reservation(self, shard: int) -> str:
        return self.shards[shard].path + ".reserved"


class ProgressReporter:
    """Turn the sampler's count of keys handed out into a position the rank's workers have all read.

    The DataLoader dispatches batch k only once batch k - depth has come back (depth = workers x
    prefetch factor, 0 without workers: batch k is read after k - 1 came back), so every sample
    of the batches before k - depth is read: positions before ``start + (k - depth) x batch x ranks``.
    """

    def __init__(self, cache: ShardCache, batch_size: int, depth: int, num_replicas: int):
        self.cache, self.batch_size, self.depth, self.num_replicas = cache, batch_size, depth, num_replicas
        self._last: Progress | None = None

    def __call__(self, epoch: int, start: int, handed_out: int) -> None:
        batches_read = max(0, handed_out // self.batch_size - self.depth)
        now = (epoch, start + batches_read * self.batch_size * self.num_replicas)
        if now != self._last:
            self._last = now
            self.cache.report(*now)
