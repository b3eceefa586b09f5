"""The bounded node-local shard cache (DATA.SHARD_CACHE_LIMIT, data/shard_cache.py) against reading from disk.

The digits are packed 60 a shard (24 train shards) and served by an HTTP server in this process
that counts the bytes of every shard it sends, per client "node" (a path prefix: /node0/...,
/node1/... are the same folder), so each check compares what a node downloaded with the dataset's
size, and what it read with the same shards read from disk.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import multiprocessing
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISREG

import pytest
import torch
from helpers import (
    EVAL_TINY,
    REPO,
    TINY_TRAIN,
    assert_ok,
    clean_env,
    in_process,
    read_metrics,
    run_torchrun,
    serving,
    two_nodes,
)
from sampler_helpers import window_stretches

from distribuuuu.config import ConfigError, get_cfg_defaults, validate_cfg
from distribuuuu.data.packed import PackedDataset, _ShardFiles
from distribuuuu.data.samplers import ShardWindowSampler
from distribuuuu.data.shard_cache import LOCKS, ShardOrder
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split

pytest.importorskip("wids")
DIGITS = REPO / "data" / "digits"
PACK = str(REPO / "tools" / "pack_dataset.py")
SHARD_SIZE = 60
WINDOW = 2


@pytest.fixture(autouse=True)
def short_wait_for_room(monkeypatch):
    """A cache that cannot make room fails in seconds here, not after minutes (and the test with it)."""
    monkeypatch.setattr("distribuuuu.data.shard_cache.ROOM_TIMEOUT_S", 20.0)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "digits"
    assert_ok(in_process(PACK, str(DIGITS), str(out), "--shard-size", str(SHARD_SIZE)))
    return out


def shard_sizes(packed: Path, split: str = "train") -> list[int]:
    return [s["filesize"] for s in json.loads((packed / split / "index.json").read_text())["shardlist"]]


class CountingServer(http.server.ThreadingHTTPServer):
    """Serves a folder under any /nodeK/ prefix and counts the bytes of each (node, file) it sends.

    ``requests`` counts the downloads of each file that reached its last byte. A ``flaky`` server,
    on train shards, honours Range requests (206), cuts every fifth response half-way through its
    body (the client sees a short body) and answers 503 to about one request in ten (seeded), as
    an object store under load does.
    """

    def __init__(self, folder: Path, flaky: bool = False):
        super().__init__(("127.0.0.1", 0), functools.partial(_CountingHandler, directory=str(folder)))
        self.sent: Counter = Counter()
        self.requests: Counter = Counter()
        self.lock = threading.Lock()
        self.flaky, self.responses, self.faults = flaky, 0, Counter()
        self.random = random.Random(0)

    def url(self, node: int = 0) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/node{node}"

    def bytes_of(self, node: int, prefix: str = "train/shard-") -> int:
        return sum(n for (k, path), n in self.sent.items() if k == node and path.startswith(prefix))

    def shard_requests(self, node: int, prefix: str = "train/shard-") -> Counter:
        return Counter({path: n for (k, path), n in self.requests.items() if k == node and path.startswith(prefix)})

    def next_fault(self) -> str:
        """What the flaky server does with the next shard request: "503", "cut" or "" (serve it)."""
        with self.lock:
            self.responses += 1
            fault = "503" if self.random.random() < 0.1 else "cut" if self.responses % 5 == 0 else ""
            self.faults[fault] += 1
            return fault


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _node_and_path(self) -> tuple[int, str]:
        _, node, rest = self.path.split("/", 2)
        return int(node.removeprefix("node")), rest

    def translate_path(self, path: str) -> str:
        return super().translate_path("/" + path.split("/", 2)[2])

    def do_GET(self) -> None:
        if not (self.server.flaky and self._node_and_path()[1].startswith("train/shard-")):
            return super().do_GET()
        fault = self.server.next_fault()
        if fault == "503":
            self.send_error(503)
            return
        data = Path(self.translate_path(self.path)).read_bytes()
        start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        end = start + (len(data) - start) // 2 if fault == "cut" else len(data)
        self.copyfile(io.BytesIO(data[start:end]), self.wfile, complete=end == len(data))

    def copyfile(self, source, outputfile, complete: bool = True) -> None:
        key = self._node_and_path()
        while block := source.read(1 << 16):
            outputfile.write(block)
            with self.server.lock:
                self.server.sent[key] += len(block)
        if complete:
            with self.server.lock:
                self.server.requests[key] += 1


@contextlib.contextmanager
def counting_server(folder: Path, flaky: bool = False) -> Iterator[CountingServer]:
    server = CountingServer(folder, flaky)
    with serving(server):
        yield server


class PeakSize:
    """The largest total size of the files under some folders, sampled every few milliseconds."""

    def __init__(self, *folders: Path):
        self.folders, self.peaks, self._stop = folders, [0] * len(folders), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakSize:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            for i, folder in enumerate(self.folders):
                self.peaks[i] = max(self.peaks[i], _size_of(folder))


def _size_of(folder: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != LOCKS]  # lock files and progress records: a few bytes
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                stat = os.lstat(os.path.join(root, name))
                total += stat.st_size if S_ISREG(stat.st_mode) else 0  # not the links to local val shards
    return total


def test_cache_follows_the_samplers_shard_windows(packed):
    """ShardOrder's windows of each epoch are the windows of the sampler's own sample order."""
    pk = PackedDataset(str(packed), "train")
    shard_of = pk.sample_shards()
    order = ShardOrder(pk.shard_samples(), seed=5, window=WINDOW)
    for epoch in (0, 1, 7):
        sampler = ShardWindowSampler(pk, 1, 0, 5, shard_of, WINDOW)
        sampler.set_epoch(epoch)
        stretches = window_stretches([i for _, i in sampler], shard_of, WINDOW)
        shards = order.shards(epoch)
        assert [{shard_of[i] for i in s} for s in stretches] == [
            set(shards[k : k + WINDOW].tolist()) for k in range(0, len(shards), WINDOW)
        ]
        position = 0
        for k, stretch in enumerate(stretches):  # every position of a stretch is in its window
            assert {order.window_at(epoch, p) for p in range(position, position + len(stretch))} == {k}
            position += len(stretch)


def _open_shard_and_exit(folder: str, url: str, shards: list[dict], start: threading.Barrier) -> None:
    start.wait()
    _ShardFiles(shards, folder)(url)


def test_processes_that_need_one_shard_at_once_share_one_download(packed, tmp_path):
    """Four processes of a node ask for the same shard at the same moment (the unbounded cache,
    DATA.SHARD_CACHE_LIMIT 0): the server sends it once, and each process gets the whole file."""
    index = json.loads((packed / "train" / "index.json").read_text())
    with counting_server(packed) as server:
        base = f"{server.url(0)}/train/"
        shards = [dict(s, url=base + s["url"]) for s in index["shardlist"]]
        ctx = multiprocessing.get_context("fork")
        start = ctx.Barrier(4)
        args = (str(tmp_path), shards[3]["url"], shards, start)
        procs = [ctx.Process(target=_open_shard_and_exit, args=args) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 4
        assert server.requests[(0, "train/shard-000003.tar")] == 1
        assert server.bytes_of(0) == shards[3]["filesize"]
    cached = tmp_path / _ShardFiles(shards, str(tmp_path)).local_path(shards[3]["url"]).rsplit("/", 1)[1]
    assert cached.read_bytes() == (packed / "train" / "shard-000003.tar").read_bytes()


def _cfg(root: str, cache: Path, limit: int, workers: int = 2):
    cfg = get_cfg_defaults()
    cfg.TRAIN.DATASET, cfg.DATA.SHARD_CACHE, cfg.DATA.SHARD_CACHE_LIMIT = root, str(cache), limit
    cfg.DATA.SHUFFLE_WINDOW, cfg.DATA.SHARD_PREFETCH, cfg.TRAIN.WORKERS = WINDOW, 1, workers
    cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.PREFETCH_FACTOR, cfg.RNG_SEED = 16, 16, 1, 3
    return cfg


def _epoch(split, epoch: int, position: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    split.sampler.set_epoch(epoch)
    split.sampler.set_position(position)
    return [(images, targets) for images, targets, _ in split.loader]


@pytest.mark.slow  # 17 s here: two loaders of 2 workers over 2.5 epochs
def test_one_rank_reads_the_disk_batches_within_the_limit_downloading_each_shard_once_an_epoch(packed, tmp_path):
    """One rank, 2 workers, a limit of 8 of the 24 shards: the batches of two epochs and of a
    resumed epoch are the disk's; the shards on disk never exceed the limit; each epoch
    downloads each shard at most once (about one copy of the split), and the resumed epoch
    downloads none of the shards it skips."""
    sizes = shard_sizes(packed)
    limit = sum(sorted(sizes)[-8:])
    disk = build_train_split(_cfg(str(packed), tmp_path / "disk", 0), DistEnv())
    with counting_server(packed) as server:
        split = build_train_split(_cfg(server.url(0), tmp_path / "cache", limit), DistEnv())
        sent = []
        with PeakSize(tmp_path / "cache") as peak:
            for epoch in (0, 1):
                batches = _epoch(split, epoch)
                sent.append(server.shard_requests(0))
                for (a, ta), (b, tb) in zip(batches, _epoch(disk, epoch), strict=True):
                    assert torch.equal(ta, tb) and torch.equal(a, b), f"epoch {epoch}"
        assert peak.peaks[0] <= limit, f"{peak.peaks[0]} bytes on disk, the limit is {limit}"
        first, second = sent[0], sent[1] - sent[0]
        assert set(first) == {f"train/shard-{k:06d}.tar" for k in range(len(sizes))}
        assert max(first.values()) == 1 and max(second.values(), default=1) == 1, "a shard twice in one epoch"
        assert sum(sizes) < server.bytes_of(0) <= 2 * sum(sizes), "the second epoch downloads again"

        skipped = 10 * 16  # resume epoch 2 after 10 steps: its first windows are never downloaded
        server.requests.clear()
        resumed = _epoch(split, 2, skipped)
        for (a, _), (b, _) in zip(resumed, _epoch(disk, 2, skipped), strict=True):
            assert torch.equal(a, b)
    order = ShardOrder(split.dataset.base.shard_samples(), 3, WINDOW)
    before = order.shards(2)[: order.window_at(2, skipped) * WINDOW].tolist()
    assert before and not {f"train/shard-{k:06d}.tar" for k in before} & set(server.shard_requests(0))


def test_limit_below_what_the_loaders_read_at_once_or_with_a_global_permutation_is_refused_naming_the_key(
    packed, tmp_path
):
    """One rank, 2 workers, prefetch factor 1, batch 16: (2 + 2) x 16 = 64 positions in flight
    touch at most 2 windows of 2 shards of >= 56 samples: the 4 largest shards' bytes."""
    need = sum(sorted(shard_sizes(packed))[-2 * WINDOW :])
    with counting_server(packed) as server:
        cfg = _cfg(server.url(0), tmp_path / "cache", need - 1)
        with pytest.raises(
            ConfigError, match=rf"^DATA.SHARD_CACHE_LIMIT {need - 1} bytes cannot hold .* least {need} "
        ):
            build_train_split(cfg, DistEnv())
        cfg.DATA.SHARD_CACHE_LIMIT = need
        build_train_split(cfg, DistEnv())
    cfg.DATA.SHUFFLE_WINDOW = 0
    with pytest.raises(ConfigError, match=r"^DATA.SHARD_CACHE_LIMIT needs DATA.SHUFFLE_WINDOW > 0"):
        validate_cfg(cfg)


def test_local_dataset_is_read_in_place_whatever_the_limit(packed, tmp_path):
    split = build_train_split(_cfg(str(packed), tmp_path / "cache", 1, workers=0), DistEnv())
    split.sampler.set_epoch(0)
    next(iter(split.loader))
    links = [p for p in (tmp_path / "cache").iterdir() if p.name != LOCKS]
    assert links and all(p.is_symlink() for p in links)


@pytest.fixture(scope="module")
def two_node_runs(packed, tmp_path_factory):
    """The runs of the test below, on the module's packed folder: (the packed folder, the
    cache limit, the disk run, the two nodes' runs, the server, the peak sizes, the OUT_DIRs' root)."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    sizes = shard_sizes(packed)
    # The least the cache accepts: (2 workers x prefetch 1 + 2) x 16 x 4 ranks = 256 positions in
    # flight touch at most 1 + ceil(256 / 112) = 4 windows of 2 shards (the last shard holds 56).
    limit = sum(sorted(sizes)[-8:])
    common = [
        *EVAL_TINY,
        "OPTIM.MAX_EPOCH",
        "2",
        "TRAIN.PRINT_FREQ",
        "10",
        "TEST.DATASET",
        str(packed),
        "DATA.SHUFFLE_WINDOW",
        str(WINDOW),
        "TRAIN.WORKERS",
        "2",
    ]
    common += ["TRAIN.BATCH_SIZE", "16", "TRAIN.PREFETCH_FACTOR", "1", "DATA.SHARD_PREFETCH", "1"]
    disk = ["OUT_DIR", str(tmp_path / "disk"), "TRAIN.DATASET", str(packed), *common]
    disk += ["DATA.SHARD_CACHE", str(tmp_path / "disk_links")]  # a local shard's link, not under /tmp
    # Launches: the reference is the same 4 ranks' metrics (their sampler order) read from disk, and
    # two torchrun agents sharing one node's cache and its downloads is the property.
    disk_run = run_torchrun(4, TINY_TRAIN, *disk, timeout=300, env=clean_env())
    with counting_server(packed, flaky=True) as server, PeakSize(tmp_path / "cache0", tmp_path / "cache1") as peak:
        nodes = [
            ["OUT_DIR", str(tmp_path / "http"), "TRAIN.DATASET", server.url(k), *common]
            + ["DATA.SHARD_CACHE", str(tmp_path / f"cache{k}"), "DATA.SHARD_CACHE_LIMIT", str(limit)]
            for k in (0, 1)
        ]
        results = two_nodes(2, TINY_TRAIN, nodes, timeout=300)  # the tiny CNN: any model will do
    return packed, limit, disk_run, results, server, peak, tmp_path


@pytest.mark.slow
def test_two_nodes_download_one_copy_an_epoch_each_within_the_limit_and_train_as_from_disk(two_node_runs):
    """Two torchrun agents as two nodes of 2 ranks and 2 workers each, each node with its own
    cache folder, read one flaky HTTP server (every fifth response cut half-way, a 503 now and
    then): each node downloads every shard once or twice in 2 epochs (one copy of the split an
    epoch, not one per rank or worker; a cut download resumes with a Range request, so the bytes
    stay one copy), its cache stays within the limit, and the metrics of 2 epochs equal a
    4-process run reading the shards from disk."""
    packed, limit, disk_run, results, server, peak, tmp_path = two_node_runs
    sizes = shard_sizes(packed)
    for result in (disk_run, *results):
        assert_ok(result)
    assert server.faults["cut"] > 0 and server.faults["503"] > 0, f"the server misbehaved: {server.faults}"
    for node in (0, 1):
        fetched = server.shard_requests(node)
        assert set(fetched) == {f"train/shard-{k:06d}.tar" for k in range(len(sizes))}
        assert max(fetched.values()) <= 2, f"node {node}: a shard downloaded more than twice in 2 epochs"
        assert sum(sizes) <= server.bytes_of(node) <= 2 * sum(sizes)
        assert 0 < peak.peaks[node] <= limit, f"node {node}: {peak.peaks[node]} bytes on disk, limit {limit}"
    keep = ("epoch", "split", "loss", "top1", "top5", "samples", "skipped_images")
    metrics = {name: [{k: r.get(k) for k in keep} for r in read_metrics(tmp_path / name)] for name in ("disk", "http")}
    assert metrics["http"] == metrics["disk"] and len(metrics["disk"]) == 4


def test_a_download_that_ends_while_its_reservation_is_looked_at_counts_its_shard(tmp_path, monkeypatch):
    """A reader sees shard 1's reservation, and before it takes the shard's lock the downloader
    finishes: the file in place, the reservation removed, the lock let go. The shard counts as on
    disk; the reader did not fail removing a reservation already gone (a two-node CI run did:
    "No such file or directory: ...shard-000006.tar.reserved")."""
    from distribuuuu.data import shard_cache as sc

    shards = [sc.ShardFile(f"http://x/shard-{i}.tar", str(tmp_path / f"shard-{i}.tar"), 100, "") for i in range(3)]
    cache = sc.ShardCache(str(tmp_path), shards, download=None, limit=10**6, prefetch=0,
                          order=sc.ShardOrder([10, 10, 10], seed=0, window=1), in_flight=1)  # fmt: skip
    Path(shards[0].path).write_bytes(b"0" * 100)  # on disk
    Path(shards[1].path + ".reserved").touch()  # being downloaded by another process
    real_flocked = sc.flocked

    def downloader_finishes_first(path, blocking=True):
        if path.endswith(os.path.basename(shards[1].path)):  # shard 1's lock: the download ends first
            Path(shards[1].path).write_bytes(b"1" * 100)
            os.unlink(shards[1].path + ".reserved")
        return real_flocked(path, blocking=blocking)

    monkeypatch.setattr(sc, "flocked", downloader_finishes_first)
    assert cache._counted() == [0, 1]
