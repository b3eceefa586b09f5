"""Download one object from a local S3 server (moto) with obstore and with fsspec's s3fs, in turn.

    python docs/scripts/compare_object_store_libs.py [MB] [REPEATS]

Starts moto's standalone S3 server on 127.0.0.1 (``pip install "moto[server]"``), uploads MB
megabytes of random bytes (50 by default) and streams the object to a local file, in 1 MiB blocks
hashed on the way (what distribuuuu's shard download does), REPEATS times per library (3 by
default), libraries in turn; prints the median MB/s (min-max) of each, then each library's import
time in a fresh interpreter (median of 5). The figures are in docs/design.md.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

BLOCK = 1 << 20


def obstore_download(endpoint: str, key: str, dest: str) -> str:
    import obstore
    from obstore.store import S3Store

    store = S3Store("bench", endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    h = hashlib.md5()
    with open(dest, "wb") as f:
        for chunk in obstore.get(store, key).stream(min_chunk_size=BLOCK):
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


def s3fs_download(endpoint: str, key: str, dest: str) -> str:
    """s3fs's file object, read in 1 MiB blocks; its block_size is the size of each ranged GET
    (8 MiB here: 1 MiB requests halve its rate against this server)."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    h = hashlib.md5()
    with fs.open(f"bench/{key}", "rb", block_size=8 * BLOCK, cache_type="readahead") as src, open(dest, "wb") as f:
        for chunk in iter(lambda: src.read(BLOCK), b""):
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


def s3fs_get_file(endpoint: str, key: str, dest: str) -> str:
    """s3fs's own whole-object download (one streamed GET), hashed afterwards."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.get_file(f"bench/{key}", dest)
    h = hashlib.md5()
    with open(dest, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def import_time(module: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
        times.append(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout))
    return statistics.median(times)


def main() -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    mb, repeats = (int(a) for a in (sys.argv[1:] + ["50", "3"][len(sys.argv) - 1 :])[:2])
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    import boto3

    data = os.urandom(mb << 20)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="bench")
    s3.put_object(Bucket="bench", Key="blob", Body=data)
    expected = hashlib.md5(data).hexdigest()
    libraries = {"obstore": obstore_download, "s3fs open+read": s3fs_download, "s3fs get_file": s3fs_get_file}
    rates: dict[str, list[float]] = {name: [] for name in libraries}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for name, download in libraries.items():
                tic = time.perf_counter()
                assert download(endpoint, "blob", os.path.join(tmp, name)) == expected, name
                rates[name].append(mb / (time.perf_counter() - tic))
    server.stop()
    for name, r in rates.items():
        print(f"{name}: {statistics.median(r):.0f} MB/s ({min(r):.0f}-{max(r):.0f}), {mb} MB object, {repeats} runs")
    for module in ("obstore", "s3fs"):
        print(f"import {module}: {import_time(module) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
