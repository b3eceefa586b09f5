"""How bytes move between here and a remote dataset: http(s):// URLs and object stores (s3://, gs://, az://).

``download`` streams an object into a local file in blocks, hashing as it writes (memory bounded
whatever the shard size), retries with exponential backoff and jitter, resumes from the bytes
already received with a Range request where the server allows it, checks the index's size and
MD5, and only then renames the file into place (``distribuuuu.files``: never a partial file at
the destination). WHICH shard is fetched WHEN is the shard cache's business, not this module's.

http(s) goes through the standard library (``urllib``): nothing to install. Object stores go
through obstore (the ``cloud`` extra; chosen by measurement, docs/design.md), which reads
credentials and endpoints from the environment as AWS/GCS/Azure tools do (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_NAME``, ...).
Its own retry configuration (5xx, connection errors, timeouts) is set from the constants below;
our loop adds the resume of a body cut mid-stream.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from distribuuuu import files
from distribuuuu.data.errors import BadImageError, DataError
from distribuuuu.errors import first_line

HTTP_PREFIXES = ("http://", "https://")
TIMEOUT_S = 60  # per HTTP request (connect, and each read): a dead server is an error, never a hang
BLOCK = 1 << 20  # bytes per read: the memory a download holds, whatever the shard size


class BadShardError(BadImageError):
    """A shard is missing, truncated or fails its checksum; the message names it."""


class _Failed(Exception):
    """A transfer failed for good (a 4xx answer, no such object, or the attempts ran out)."""


class _Transient(_Failed):
    """A failure worth another attempt (connection error, timeout, 5xx, 429, a body cut short)."""


@dataclass(frozen=True)
class Retry:
    """A bounded number of attempts, waiting ``backoff_s`` x 2^k (at most ``max_backoff_s``) between them.

    Jitter ("equal jitter": half the wait fixed, half random) keeps the ranks and workers of a
    job that failed together from retrying in lockstep against the same server.
    """

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 16.0

    def wait(self, attempt: int) -> float:
        full = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return full / 2 + random.uniform(0, full / 2)


RETRY = Retry()  # tests swap in a tiny backoff


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(root: str) -> bool:
    """A dataset root that is a URL (http(s)://, s3://, gs://, az://, ...), anything but a local path."""
    return bool(_URL.match(root)) and not root.startswith("file://")


def join(base: str, name: str) -> str:
    """``name`` relative to the folder ``base`` (a path or a URL); an absolute ``name`` is kept."""
    if is_remote(name) or os.path.isabs(name):
        return name
    return f"{base.rstrip('/')}/{name}" if is_remote(base) else os.path.join(base, name)


def read_bytes(url: str) -> bytes:
    """The whole body of a small remote object (index.json), retried; DataError naming the URL on failure."""

    def attempt() -> bytes:
        with _opened(url, 0) as (_, blocks):
            return b"".join(blocks)

    try:
        return _retried(attempt)
    except _Failed as e:
        raise DataError(f"cannot read {url}: {e}") from None


def download(url: str, dest: str, filesize: int, md5: str) -> None:
    """Fetch ``url`` into the local file ``dest``, checked against ``filesize`` and ``md5``; BadShardError if not."""
    with files.atomic_write(dest) as f:
        state = _Progress(f)
        try:
            _retried(lambda: _receive(url, state))
        except _Failed as e:
            raise BadShardError(f"shard {url}: {e}") from None
        if state.received != filesize or state.md5.hexdigest() != md5:
            raise BadShardError(
                f"shard {url}: {state.received} bytes (MD5 {state.md5.hexdigest()}) that fail the index's "
                f"size/MD5 check ({filesize} bytes, MD5 {md5})"
            )


def upload(local: str, url: str) -> None:
    """Copy the local file ``local`` to the object-store ``url`` (s3://, gs://, az://)."""
    if url.startswith(HTTP_PREFIXES) or not is_remote(url):
        raise DataError(f"cannot upload to {url}: writing needs an object store URL (s3://, gs://, az://)")
    obstore, store, path = _object_store(url)
    try:
        with open(local, "rb") as f:
            obstore.put(store, path, f)  # multipart for large files, the library's retries per part
    except (obstore.exceptions.BaseError, OSError) as e:
        raise DataError(f"cannot write {url}: {first_line(e)}") from None


class _Progress:
    """What one download has received so far: the open file, its length and running MD5."""

    def __init__(self, f) -> None:
        self.f, self.received, self.md5 = f, 0, hashlib.md5()

    def restart(self) -> None:
        self.f.seek(0)
        self.f.truncate()
        self.received, self.md5 = 0, hashlib.md5()


def _receive(url: str, state: _Progress) -> None:
    """One attempt: continue from ``state.received`` (a Range request), or start over if the server sends it all."""
    with _opened(url, state.received) as (offset, blocks):
        if offset != state.received:
            state.restart()  # the server ignored the Range header: a whole body follows
        for block in blocks:
            state.f.write(block)
            state.md5.update(block)
            state.received += len(block)


def _retried(attempt):
    """``attempt()``, again after a backoff while it fails transiently; _Failed when the attempts run out."""
    for k in range(RETRY.attempts):
        try:
            return attempt()
        except _Transient as e:
            last = e
            if k + 1 < RETRY.attempts:
                time.sleep(RETRY.wait(k))
    raise _Failed(f"gave up after {RETRY.attempts} attempts, last error: {last}")


@contextlib.contextmanager
def _opened(url: str, start: int) -> Iterator[tuple[int, Iterator[bytes]]]:
    """The body of ``url`` from byte ``start`` if the server allows: (the offset it starts at, its blocks)."""
    if url.startswith(HTTP_PREFIXES):
        with _http_body(url, start) as body:
            yield body
    else:
        yield _store_body(url, start)


@contextlib.contextmanager
def _http_body(url: str, start: int) -> Iterator[tuple[int, Iterator[bytes]]]:
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code >= 500 or e.code == 429:
            raise _Transient(f"HTTP {e.code} {e.reason}") from None
        raise _Failed(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
        raise _Transient(first_line(getattr(e, "reason", e))) from None
    with response:
        # 206: the rest of the body from our start; 200: the server ignored Range and sends it all.
        if response.status == 206 and not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise _Transient(f"asked for bytes {start}-, got {response.headers.get('Content-Range')}")
        yield (start if response.status == 206 else 0), _http_blocks(response)


def _http_blocks(response) -> Iterator[bytes]:
    expected = response.length  # what is left of Content-Length; None if the server did not say
    try:
        while block := response.read(BLOCK):
            yield block
    except (http.client.HTTPException, ConnectionError, TimeoutError) as e:
        raise _Transient(f"connection lost mid-body: {first_line(e)}") from None
    if expected is not None and response.length:
        raise _Transient(f"body ended {response.length} bytes short")


def _store_body(url: str, start: int) -> tuple[int, Iterator[bytes]]:
    obstore, store, path = _object_store(url)
    errors = obstore.exceptions
    permanent = (PermissionError, errors.PermissionDeniedError, errors.UnauthenticatedError, errors.InvalidPathError)
    try:
        result = obstore.get(store, path, options={"range": {"offset": start}} if start else None)
    except FileNotFoundError:
        raise _Failed("no such object (or bucket)") from None
    except permanent as e:
        raise _Failed(first_line(e)) from None
    except (obstore.exceptions.BaseError, OSError) as e:  # after the library's own retries
        raise _Transient(first_line(e)) from None

    def blocks() -> Iterator[bytes]:
        try:
            for chunk in result.stream(min_chunk_size=BLOCK):
                yield bytes(chunk)
        except (obstore.exceptions.BaseError, OSError) as e:
            raise _Transient(f"connection lost mid-body: {first_line(e)}") from None

    return start, blocks()


_STORES: dict = {}


def _object_store(url: str):
    """(the obstore module, a store for the URL's bucket, the path in it); one store per bucket and process.

    Per process: a DataLoader worker forked from a process that held a store must not share its
    client (its connection pool and async runtime belong to the parent).
    """
    try:
        import obstore
        from obstore.store import from_url
    except ImportError:
        raise DataError(f"reading {url} needs obstore: pip install 'distribuuuu[cloud]'") from None
    scheme, rest = url.split("://", 1)
    bucket, _, path = rest.partition("/")
    key = (os.getpid(), scheme, bucket)
    if key not in _STORES:
        try:
            _STORES[key] = from_url(f"{scheme}://{bucket}", client_options=_CLIENT, retry_config=_retry_config())
        except (obstore.exceptions.BaseError, ValueError) as e:
            raise DataError(f"cannot open {scheme}://{bucket}: {first_line(e)}") from None
    return obstore, _STORES[key], path


# Passing client options replaces the ones the library reads from the environment, so http
# endpoints (AWS_ENDPOINT_URL=http://... of a local S3-compatible server) are allowed here; the
# endpoint the user sets decides the scheme. The overall request timeout is off (obstore's default
# of 30 s would cut a large shard on a slow link); connect and per-read timeouts catch a dead server.
_CLIENT = {"allow_http": True, "connect_timeout": f"{TIMEOUT_S}s", "read_timeout": f"{TIMEOUT_S}s", "timeout": "24h"}


def _retry_config() -> dict:
    return {
        "max_retries": RETRY.attempts - 1,
        "backoff": {
            "init_backoff": timedelta(seconds=RETRY.backoff_s),
            "max_backoff": timedelta(seconds=RETRY.max_backoff_s),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=RETRY.max_backoff_s * RETRY.attempts),
    }
