"""Read the same JPEGs through wids (WebDataset), LitData and MosaicML Streaming: random access,
bytes alone and through the 224-pixel training transform, one process, libraries in turn.

    PYTHONPATH=<litdata and mosaicml-streaming install> python docs/scripts/compare_stream_libs.py [N] [REPEATS]

The figures are in docs/design.md. LitData and MosaicML Streaming are not dependencies of
distribuuuu (streaming 0.13 pins numpy<2.2 and imports transformers): install them apart, e.g.
``pip install --target DIR --no-deps ...``, and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))

from benchmark import make_photo_folder  # noqa: E402

from distribuuuu.config import get_cfg_defaults  # noqa: E402
from distribuuuu.data.datasets import seeded_cpu_rng  # noqa: E402
from distribuuuu.data.encoded import decode_image_bytes  # noqa: E402
from distribuuuu.data.pack import PackOptions, pack_split  # noqa: E402
from distribuuuu.data.packed import PackedDataset  # noqa: E402
from distribuuuu.training.preprocessing import build_train_transform  # noqa: E402


def samples(photos: str) -> list[tuple[bytes, int]]:
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(photos, "train")) for f in fs)
    return [(open(f, "rb").read(), int(os.path.basename(os.path.dirname(f))[-1])) for f in files]


def build_wids(photos: str, out: str):
    pack_split(photos, "train", out, PackOptions(shard_size=500))
    ds = PackedDataset(out, "train")
    return lambda i: ds.encoded(i)[0]


def _litdata_item(sample):
    return {"jpg": sample[0], "cls": sample[1]}


def build_litdata(data: list, out: str):
    import litdata

    litdata.optimize(_litdata_item, data, out, chunk_bytes="32MB", num_workers=1, mode="overwrite")
    ds = litdata.StreamingDataset(out)
    return lambda i: ds[i]["jpg"]


def build_mosaic(data: list, out: str):
    from streaming import MDSWriter, StreamingDataset

    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="32mb") as writer:
        for jpg, cls in data:
            writer.write({"jpg": jpg, "cls": cls})
    ds = StreamingDataset(local=out, batch_size=1)
    return lambda i: ds[i]["jpg"]


def main() -> None:
    n, repeats = (int(a) for a in (sys.argv[1:] + ["1000", "3"])[:2])
    torch.set_num_threads(1)  # one core: the figures are per core
    root = tempfile.mkdtemp(prefix="libcmp-")
    photos = make_photo_folder(os.path.join(root, "photos"), n, mixed=True)
    data = samples(photos)
    readers = {"wids": build_wids(photos, os.path.join(root, "wids"))}
    for name, build in (("litdata", build_litdata), ("mosaic", build_mosaic)):
        try:
            readers[name] = build(data, os.path.join(root, name))
        except ImportError as e:
            print(f"{name}: not installed ({e})")
    cfg = get_cfg_defaults()
    cfg.TRAIN.IM_SIZE = 224
    transform = build_train_transform(cfg)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    for i in order[:50]:  # every reader returns the bytes that were packed
        assert all(read(i) == data[i][0] for read in readers.values())
    rates = {(name, what): [] for name in readers for what in ("bytes", "pipeline")}
    for _ in range(repeats):
        for name, read in readers.items():
            tic = time.perf_counter()
            for i in order:
                read(i)
            rates[name, "bytes"].append(len(order) / (time.perf_counter() - tic))
            tic = time.perf_counter()
            for i in order[: n // 2]:
                with seeded_cpu_rng(i):
                    transform(decode_image_bytes(read(i), "x.jpg", "torchvision"))
            rates[name, "pipeline"].append((n // 2) / (time.perf_counter() - tic))
    for (name, what), values in rates.items():
        print(
            f"{name:<8} {what:<8} median {statistics.median(values):9.1f} img/s  (min {min(values):.1f}, max {max(values):.1f})"
        )


if __name__ == "__main__":
    main()
