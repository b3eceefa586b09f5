"""Shard downloads over HTTP (data/remote.py) against a misbehaving server on 127.0.0.1.

The server is a thread of this process (``http.server``, threaded) that answers each request by a
script: ``drop`` sends half of what is left of the body and closes the connection, ``503`` answers
Service Unavailable, ``ok`` sends the body; it honours Range requests or ignores them, and counts
every byte it writes. Each check compares the file on disk with the bytes served (MD5) and the
bytes served with what a resumed or a restarted download must cost.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import itertools
import os
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from helpers import serving

from distribuuuu.data import DataError, remote
from distribuuuu.data.packed import BadShardError, _ShardFiles
from distribuuuu.runtime.launcher import find_free_port

TINY_BACKOFF = remote.Retry(attempts=5, backoff_s=0.001, max_backoff_s=0.01)


@pytest.fixture(autouse=True)
def tiny_backoff(monkeypatch):
    monkeypatch.setattr(remote, "RETRY", TINY_BACKOFF)


@dataclass
class Script:
    """What the server does, request after request (cycled), and what it has sent."""

    steps: list[str]
    honour_range: bool = True
    served: int = 0  # body bytes written, all requests
    requests: list[str] = field(default_factory=list)  # the step taken for each request
    ranges: list[str | None] = field(default_factory=list)  # each request's Range header
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._cycle = itertools.cycle(self.steps)

    def next_step(self, range_header: str | None) -> str:
        with self.lock:
            step = next(self._cycle)
            self.requests.append(step)
            self.ranges.append(range_header)
            return step


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # Content-Length bodies: a dropped connection is a short body

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        script, data = self.server.script, self.server.files.get(self.path)
        step = script.next_step(self.headers.get("Range"))
        if data is None or step == "503":
            self.send_error(404 if data is None else 503)
            return
        start = 0
        if script.honour_range and self.headers.get("Range"):
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = memoryview(data)[start:]  # a view: the memory test counts this thread's allocations too
        end = len(body) // 2 if step == "drop" else len(body)
        for at in range(0, end, 64 << 10):
            self.wfile.write(body[at : min(end, at + (64 << 10))])
            with script.lock:
                script.served += min(end, at + (64 << 10)) - at
        if step == "drop":
            self.close_connection = True  # mid-body: the client sees fewer bytes than Content-Length


@contextlib.contextmanager
def scripted_server(files: dict[str, bytes], script: Script) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedHandler)
    server.daemon_threads = True
    server.script, server.files = script, files
    with serving(server) as url:
        yield url


def _blob(megabytes: float) -> bytes:
    return os.urandom(int(megabytes * (1 << 20)))


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_a_flaky_server_still_yields_the_exact_file_resumed_where_range_is_honoured(tmp_path, honour_range):
    """Two dropped connections and a 503 before the body comes whole. With Range, each attempt
    continues where the last one stopped: the server sends the file once in all. Without it,
    each attempt starts over: the halves sent before each drop are sent again."""
    data = _blob(5)
    script = Script(["drop", "503", "drop", "ok"], honour_range=honour_range)
    with scripted_server({"/shard.tar": data}, script) as url:
        remote.download(f"{url}/shard.tar", str(tmp_path / "shard.tar"), len(data), _md5(data))
    assert _md5((tmp_path / "shard.tar").read_bytes()) == _md5(data)
    assert os.listdir(tmp_path) == ["shard.tar"], "no temporary file left behind"
    assert script.requests == ["drop", "503", "drop", "ok"]
    if honour_range:
        half, quarter = len(data) // 2, len(data) // 4
        assert script.ranges == [None, f"bytes={half}-", f"bytes={half}-", f"bytes={half + quarter}-"]
        assert script.served == len(data), "resumed: every byte sent once"
    else:
        assert script.served == 2 * len(data), "restarted: half, half again, then the whole file"


def test_shard_files_fetch_a_shard_through_dropped_connections_and_503s(tmp_path):
    """The packed reader's fetch hook (what wids calls) gets the exact shard from a flaky server."""
    data = _blob(2)
    with scripted_server({"/train/shard-000000.tar": data}, Script(["drop", "503", "ok"])) as url:
        shard = {"url": f"{url}/train/shard-000000.tar", "filesize": len(data), "md5sum": _md5(data)}
        local = _ShardFiles([shard], str(tmp_path / "cache"))(shard["url"])
    with open(local, "rb") as f:
        assert _md5(f.read()) == _md5(data)


def test_a_server_that_always_answers_503_fails_in_one_line_naming_the_url_after_the_bounded_attempts(tmp_path):
    data = _blob(0.1)
    script = Script(["503"])
    with scripted_server({"/s.tar": data}, script) as url:
        tic = time.perf_counter()
        with pytest.raises(BadShardError) as failed:
            remote.download(f"{url}/s.tar", str(tmp_path / "s.tar"), len(data), _md5(data))
        elapsed = time.perf_counter() - tic
    message = str(failed.value)
    assert "\n" not in message and f"{url}/s.tar" in message and "503" in message, message
    assert f"after {TINY_BACKOFF.attempts} attempts" in message, message
    assert len(script.requests) == TINY_BACKOFF.attempts and elapsed < 5
    assert os.listdir(tmp_path) == [], "nothing at dest, no temporary file"


def test_a_missing_object_fails_at_once_and_a_checksum_mismatch_leaves_no_file(tmp_path):
    data = _blob(0.1)
    script = Script(["ok"])
    with scripted_server({"/s.tar": data}, script) as url:
        with pytest.raises(BadShardError, match=rf"shard {url}/missing\.tar: HTTP 404"):
            remote.download(f"{url}/missing.tar", str(tmp_path / "m.tar"), len(data), _md5(data))
        assert len(script.requests) == 1, "a 404 is not retried"
        with pytest.raises(BadShardError, match=rf"shard {url}/s\.tar: {len(data)} bytes .* fail the index's size/MD5"):
            remote.download(f"{url}/s.tar", str(tmp_path / "s.tar"), len(data), _md5(b"other bytes"))
    assert os.listdir(tmp_path) == []


def test_a_download_holds_a_few_blocks_in_memory_not_the_file(tmp_path, monkeypatch):
    """20 MB through 64 KiB blocks: the peak of Python allocations (this process, the server's
    thread included) stays under 1 MB, where reading the body whole would take 20."""
    monkeypatch.setattr(remote, "BLOCK", 64 << 10)
    data = _blob(20)
    with scripted_server({"/big.tar": data}, Script(["drop", "ok"])) as url:
        tracemalloc.start()
        try:
            remote.download(f"{url}/big.tar", str(tmp_path / "big.tar"), len(data), _md5(data))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert _md5((tmp_path / "big.tar").read_bytes()) == _md5(data)
    assert peak < 1 << 20, f"peak {peak / (1 << 20):.1f} MB"


def test_read_bytes_retries_and_names_the_url_when_it_cannot():
    with scripted_server({"/index.json": b'{"a": 1}'}, Script(["503", "drop", "ok"])) as url:
        assert remote.read_bytes(f"{url}/index.json") == b'{"a": 1}'
    dead = f"http://127.0.0.1:{find_free_port()}/digits/train/index.json"
    with pytest.raises(DataError, match=rf"^cannot read {dead}: gave up after 5 attempts, last error: .*refused"):
        remote.read_bytes(dead)


def test_remote_roots_and_joins():
    for root in ("http://h/x", "https://h/x", "s3://bucket/x", "gs://bucket", "az://acct/c/x"):
        assert remote.is_remote(root), root
    for root in ("/data/digits", "data/digits", "cifar10:/data/cifar", "file:///data/x"):
        assert not remote.is_remote(root), root
    assert remote.join("s3://b/digits/train", "shard-000000.tar") == "s3://b/digits/train/shard-000000.tar"
    assert remote.join("http://h/d/train/", "s.tar") == "http://h/d/train/s.tar"
    assert remote.join("/data/train", "s.tar") == os.path.join("/data/train", "s.tar")
    assert remote.join("s3://b/train", "gs://other/s.tar") == "gs://other/s.tar"
    assert remote.join("/data/train", "/elsewhere/s.tar") == "/elsewhere/s.tar"
