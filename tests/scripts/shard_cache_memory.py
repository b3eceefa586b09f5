"""Peak memory of the training loader's workers reading a URL's shards through the bounded cache, per shard size.

    OMP_NUM_THREADS=1 python tests/scripts/shard_cache_memory.py --images 600 --shard-sizes 20,300

Writes ``--images`` synthetic 256x256 JPEGs (noise: ~50 kB each) as an ImageFolder, packs them
with each shard size, serves the packs over HTTP on 127.0.0.1 and reads one epoch through
build_train_split (DATA.SHUFFLE_WINDOW 1, a limit of 8 shards, 2 workers, batch 16) while a thread
samples /proc/PID/status of the process and its workers every 10 ms. Prints one line per shard
size: the shard size in bytes and the peak RssAnon (the process's own memory) and RssFile (file
pages mapped and touched, here the memory-mapped shards: the kernel may reclaim them) of the
workers and of the main process (which prefetches, so holds a download in memory while
packed.download reads a shard whole).
"""

import argparse
import functools
import http.server
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distribuuuu.config import get_cfg_defaults  # noqa: E402
from distribuuuu.data.pack import PackOptions, pack_split  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv  # noqa: E402
from distribuuuu.training.inputs import build_train_split  # noqa: E402


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def sample_peaks(stop: threading.Event, peaks: dict) -> None:
    me = os.getpid()
    while not stop.wait(0.01):
        for who, pids in (("main", [me]), ("worker", children(me))):
            for pid in pids:
                for field in ("RssAnon", "RssFile"):
                    peaks[who, field] = max(peaks.get((who, field), 0), status_kb(pid, field))


def measure(root: str, cache: str, limit: int) -> dict:
    cfg = get_cfg_defaults()
    cfg.TRAIN.DATASET, cfg.DATA.SHARD_CACHE, cfg.DATA.SHARD_CACHE_LIMIT = root, cache, limit
    cfg.DATA.SHUFFLE_WINDOW, cfg.TRAIN.WORKERS, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.IM_SIZE = 1, 2, 16, 64
    split = build_train_split(cfg, DistEnv())
    split.sampler.set_epoch(0)
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=sample_peaks, args=(stop, peaks), daemon=True)
    sampler.start()
    for _ in split.loader:
        pass
    stop.set()
    sampler.join()
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--shard-sizes", default="20,300")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.images):
            folder = Path(tmp, "src", "train", f"c{i % 4}")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=90)
        for size in map(int, args.shard_sizes.split(",")):
            out = Path(tmp, f"packed-{size}")
            pack_split(str(Path(tmp, "src")), "train", str(out), PackOptions(shard_size=size))
            shard_bytes = max(
                s["filesize"] for s in json.loads((out / "train" / "index.json").read_text())["shardlist"]
            )
            handler = functools.partial(_QuietHandler, directory=str(out))
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            url = f"http://127.0.0.1:{server.server_address[1]}"
            limit = 8 * shard_bytes  # (2 x 2 + 2) x 16 = 96 positions in flight: <= 1 + ceil(96 / 20) windows
            peaks = measure(url, str(Path(tmp, f"cache-{size}")), limit)
            server.shutdown()
            line = " ".join(f"{who} {field} {kb / 1024:.1f} MiB" for (who, field), kb in sorted(peaks.items()))
            print(f"{size} images a shard, {shard_bytes / 2**20:.1f} MiB a shard: {line}", flush=True)


if __name__ == "__main__":
    main()
