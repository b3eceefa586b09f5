"""Packed datasets: WebDataset tar shards with a ``wids`` index, read by sample index.

Layout (what tools/pack_dataset.py writes), for each split::

    ROOT/SPLIT/index.json          wids shard index (``wids-shard-index-v1``) plus our keys
    ROOT/SPLIT/shard-000000.tar    WebDataset tar: <key>.jpg|png and <key>.cls per sample

ROOT is a local folder or a URL: http(s)://, or an object store's (s3://, gs://, az://; data/remote.py).
``wids.ShardListDataset`` (webdataset's indexed reader, chosen by measurement: docs/design.md)
maps a global index to a shard, whose sample is read from the memory-mapped tar by our
``TarSamples`` (data/tar_samples.py: wids's own tar index held 375 B a sample in every reader).
Because the packed dataset is a map-style Dataset,
the samplers are unchanged: ResumableDistributedSampler still gives exactly-once, deterministic
order, global-position resume, and ExactEvalSampler exact evaluation, whatever the world size.
``sample_shards`` tells DATA.SHUFFLE_WINDOW's sampler which shard holds each sample.

Shard fetching is ours (``_ShardFiles``), passed to wids as its ``localname`` hook: wids itself
downloads with ``curl`` through ``os.system`` with no timeout, writes the final file in place (an
interrupted download leaves a truncated shard in its cache) and does not check the index's
checksums. Here a download (``remote.download``) is streamed to disk, retried and resumed, lands
under a temporary name, is checked against the index's size and MD5, and only then takes its
final name; a local shard is read in place, its
size checked against the index (a truncated shard is named, not half-read), through a symbolic
link in the cache folder. The ranks and
workers of a node that need a shard at once share one download (a lock file per shard). With
DATA.SHARD_CACHE_LIMIT the training split reads through a bounded cache instead
(``read_through``, data/shard_cache.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from distribuuuu.data.encoded import EncodedSamples
from distribuuuu.data.errors import DataError, import_extra
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS
from distribuuuu.data.index import Labels, Samples, Strings
from distribuuuu.data.remote import BadShardError, download, is_remote, join, read_bytes
from distribuuuu.data.shard_cache import ShardCache, ShardCacheError, ShardFile, fetch_once
from distribuuuu.data.tar_samples import TarSamples

INDEX = "index.json"
KIND = "wids-shard-index-v1"
IMAGE_EXTS = ("jpg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm", "pbm")
# Shards each reader keeps open through a bounded cache (read_through): its DATA.SHUFFLE_WINDOW
# order reads a window of a few at a time, and a shard the cache evicts must close to free its disk.
LRU_SIZE = 4
FD_HEADROOM = 256  # file descriptors left to the rest of the process (sockets, pipes, logs)


def index_location(root: str, split: str) -> str:
    """Where a packed split's index lives: ROOT/SPLIT/index.json (a path or a URL)."""
    return join(join(root, split), INDEX)


def is_packed(root: str, split: str) -> bool:
    """A URL, or a local folder whose split holds an index.json."""
    return is_remote(root) or os.path.isfile(index_location(root, split))


def load_index(location: str) -> dict:
    """Read and check a packed split's index.json (path or URL)."""
    try:
        if is_remote(location):
            index = json.loads(read_bytes(location))
        else:
            with open(location) as f:
                index = json.load(f)
    except DataError:
        raise  # read_bytes names the URL and why already
    except (OSError, ValueError) as e:
        raise DataError(f"packed index {location} does not load: {e}") from None
    if index.get("__kind__") != KIND or not isinstance(index.get("shardlist"), list):
        raise DataError(f"{location} is not a packed index (expected __kind__ {KIND!r} and a shardlist)")
    counted = sum(s["nsamples"] for s in index["shardlist"])
    if counted != len(index.get("samples", ())):
        raise DataError(f"{location}: shards hold {counted} samples, the index names {len(index.get('samples', ()))}")
    return index


def md5_of(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _ShardFiles:
    """wids's ``localname`` hook: the local file of a shard URL, fetched (once per node) and checked first."""

    def __init__(self, shards: list[dict], cache_dir: str):
        self.by_url = {s["url"]: s for s in shards}
        self.cache_dir = cache_dir

    def local_path(self, url: str) -> str:
        """Where the cache folder keeps shard ``url`` (or its link, for a local shard)."""
        return os.path.join(self.cache_dir, hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + os.path.basename(url))

    def __call__(self, url: str) -> str:
        desc = self.by_url[url]
        os.makedirs(self.cache_dir, exist_ok=True)
        local = self.local_path(url)
        if not is_remote(url):
            # A symbolic link, not a copy: every shard is opened from the cache folder, and the
            # dataset's own folder may be read-only.
            self._check_size(url, desc)
            if not os.path.islink(local) or os.readlink(local) != os.path.abspath(url):
                tmp = f"{local}.{os.getpid()}.link"
                os.symlink(os.path.abspath(url), tmp)
                os.replace(tmp, local)
            return local

        def is_ready() -> bool:  # absent, or another version of the shard
            return os.path.isfile(local) and os.path.getsize(local) == desc["filesize"]

        # The node's ranks and workers share one download: the others wait for it, then read the file.
        fetch_once(self.cache_dir, local, is_ready, lambda: download(url, local, desc["filesize"], desc["md5sum"]))
        return local

    @staticmethod
    def _check_size(path: str, desc: dict) -> None:
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise BadShardError(f"shard {path} cannot be read: {e}") from None
        if size != desc["filesize"]:
            raise BadShardError(f"shard {path} is {size} bytes, the index says {desc['filesize']} (truncated?)")


class _OpenShards:
    """wids's ``LRUShards``: the shards a reader keeps open (``lru_size``, the least recently read
    closed first), each opened by ``open_stream(url)`` and read as a TarSamples (data/tar_samples.py:
    one int64 a sample where wids's own index holds 375 B). A bounded cache (DATA.SHARD_CACHE_LIMIT)
    opens a shard itself, under the shard's lock, so an eviction cannot remove it between the check
    and the open (wids's own path would then fetch it again with ``curl``)."""

    def __init__(self, open_stream: Callable[[str], BinaryIO], lru_size: int):
        self.open_stream, self.lru_size = open_stream, lru_size
        self.lru: collections.OrderedDict = collections.OrderedDict()
        self.accesses = self.misses = 0  # what wids's miss-rate warning reads

    def get_shard(self, url: str) -> TarSamples:
        self.accesses += 1
        if url in self.lru:
            self.lru.move_to_end(url)
            return self.lru[url]
        self.misses += 1
        stream = self.open_stream(url)
        self.lru[url] = TarSamples(path=stream.name, stream=stream)
        while len(self.lru) > self.lru_size:
            self.lru.popitem(last=False)[1].close()
        return self.lru[url]

    def clear(self) -> None:
        while self.lru:
            self.lru.popitem()[1].close()

    def __len__(self) -> int:
        return len(self.lru)


def _open_local(files: _ShardFiles, url: str) -> BinaryIO:
    """Shard ``url``'s file, fetched and checked first (``_ShardFiles``); unbuffered: it is read
    through its memory map, and a buffer would be 4-8 KiB more for every shard a reader keeps open."""
    return open(files(url), "rb", buffering=0)


def _open_cached(cache: ShardCache, shard_of: dict[str, int], url: str) -> BinaryIO:
    """Shard ``url`` opened by the bounded cache, under its lock."""
    return cache.open(shard_of[url])


def open_shards_limit(shards: int) -> int:
    """How many shards a reader keeps open: all of them, as far as the process may open files.

    The default order is a global permutation (DATA.SHUFFLE_WINDOW 0): any sample may come from any
    shard. With wids' few open shards nearly every read reopened one, which re-scans its tar
    headers: on an H200 host, 500x375 JPEGs in shards of 1,000 were read at 106 images/s per worker
    where the same files as an ImageFolder gave 3,158 (docs/gpu.md); on this CPU, 1.34 ms a sample
    with 4 of 12 shards open, 0.06 ms with all 12. An open shard is memory-mapped: address space and
    one file descriptor, its pages read on demand. The soft RLIMIT_NOFILE is raised toward the hard
    one (any process may) where the shards need it, before the DataLoader's workers inherit it.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system: no limit to read
        return shards
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = shards + FD_HEADROOM
    allowed = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < allowed:
        soft = allowed
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    room = shards if soft == resource.RLIM_INFINITY else soft - FD_HEADROOM
    return max(LRU_SIZE, min(shards, room))


def default_cache_dir(root: str) -> str:
    """Where shards read from a URL are kept: one folder per dataset URL, under the temp dir."""
    return os.path.join(tempfile.gettempdir(), "distribuuuu-shards", hashlib.sha256(root.encode()).hexdigest()[:16])


@dataclass(frozen=True)
class PackedIndex:
    """A packed split's index.json as the reader holds it: class names, (name, target) samples in
    arrays (data/index.py), the shard list."""

    classes: list[str]
    samples: Samples
    shardlist: list[dict]


def read_packed_index(root: str, split: str) -> PackedIndex:
    """The split's index.json (a path or a URL), checked (load_index), its samples in arrays."""
    import_extra("wids", f"reading the packed dataset {root}", "data")  # what reads the shards: first
    location = index_location(root, split)
    index = load_index(location)
    listed = index["samples"]
    # A target is a class index, or a list of them (a multi-label annotation file's sample).
    multilabel = [isinstance(t, list) for _, t in listed]
    if any(multilabel) and not all(multilabel):
        raise DataError(f"{location}: some samples have a class index, others a list of them")
    try:
        names = Strings.of(name for name, _ in listed)
        labels = Labels.of([t for _, t in listed], multilabel=bool(listed) and multilabel[0])
    except (TypeError, ValueError) as e:
        raise DataError(f"{location}: samples are not (name, class index) pairs: {e}") from None
    return PackedIndex(list(index["classes"]), Samples(names, labels), index["shardlist"])


class PackedDataset(EncodedSamples):
    """A packed split as a map-style dataset of (image, target), like CheckedImageFolder.

    ``samples`` lists (name, target) with the original relative path as the name, and
    ``targets`` / ``classes`` are ImageFolder's: class remapping (data/classes.py) and the weighted
    sampler work unchanged. Sample i is read from the shards' global row ``samples.row(i)``.
    ``index``: the split's index already read (read_packed_index; by one rank for all).
    """

    def __init__(
        self,
        root: str,
        split: str,
        decoder: str = "auto",
        cache_dir: str = "",
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        index: PackedIndex | None = None,
    ):
        wids = import_extra("wids", f"reading the packed dataset {root}", "data")  # only when one is read

        self.location = index_location(root, split)
        index = index if index is not None else read_packed_index(root, split)
        super().__init__(index.samples, list(index.classes), decoder, max_pixels)
        base = self.location.rsplit("/", 1)[0]
        shards = [dict(s, url=join(base, s["url"])) for s in index.shardlist]
        self.remote = is_remote(root)
        self.files = _ShardFiles(shards, cache_dir or default_cache_dir(root))
        with contextlib.redirect_stderr(io.StringIO()):  # wids prints a summary line on every construction
            self.shards = wids.ShardListDataset(shards, localname=self.files, transformations=[])
        self.shards.cache = _OpenShards(functools.partial(_open_local, self.files), open_shards_limit(len(shards)))

    def shard_files(self) -> list[ShardFile]:
        """Each shard's URL, its place in the cache folder, its size and MD5 (the index's)."""
        return [
            ShardFile(s["url"], self.files.local_path(s["url"]), s["filesize"], s["md5sum"]) for s in self.shards.shards
        ]

    def shard_samples(self) -> list[int]:
        """How many samples each shard holds (the index's)."""
        return [s["nsamples"] for s in self.shards.shards]

    def read_through(self, cache: ShardCache) -> None:
        """Read the shards through a bounded cache (DATA.SHARD_CACHE_LIMIT) instead of wids's unbounded one."""
        shard_of = {s["url"]: i for i, s in enumerate(self.shards.shards)}
        self.shards.cache = _OpenShards(functools.partial(_open_cached, cache, shard_of), LRU_SIZE)

    def read_row(self, row: int, name: str) -> tuple[bytes, str]:
        try:
            sample = self.shards[row]
        except (BadShardError, ShardCacheError):
            raise
        except Exception as e:  # wids parses the tar lazily: a damaged one fails here
            raise BadShardError(f"shard {self._shard_url(row)} (sample {row}, {name}) does not read: {e}") from None
        ext = next((k for k in IMAGE_EXTS if "." + k in sample), None)
        if ext is None or sample["__key__"] != key_of(row):
            raise BadShardError(
                f"shard {self._shard_url(row)}: row {row} is not sample {name} (no {key_of(row)}.<image>)"
            )
        # The name ends in the format: the decoders choose by suffix (torchvision.io for JPEG in "auto").
        return sample["." + ext].getvalue(), f"{name} from {self._shard_url(row)}:{key_of(row)}.{ext}"

    def sample_shards(self) -> list[int]:
        """The shard (its place in the index's shard list) that each sample is read from."""
        return self._shards_of(self.samples.all_rows()).tolist()

    def _shard_url(self, row: int) -> str:
        return self.shards.shards[int(self._shards_of(row))]["url"]

    def _shards_of(self, rows) -> np.ndarray:
        return np.searchsorted(self.shards.cum_lengths, rows, side="right")


def key_of(row: int) -> str:
    """A sample's WebDataset key: its global row, zero-padded (no dots: WebDataset splits at the first)."""
    return f"{row:09d}"
