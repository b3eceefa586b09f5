"""Pack an ImageFolder, CIFAR or annotation-file split into WebDataset shards with a wids index
(tools/pack_dataset.py).

Samples are shuffled across shards by default (``shuffle_seed``), so every shard holds a mix of
the classes: a shard-aware order (DATA.SHUFFLE_WINDOW) then trains on all classes at once, where
shards cut from ImageFolder's sorted, class-by-class order would hold one or two classes each.
The index lists the samples in the shards' order (sample i is row i: the reader maps each name to
its row by its place in that list); ``shuffle_seed=None`` keeps the dataset's own order.

A run is idempotent and resumable. Samples go to shards ``shard_size`` at a time. Each finished
shard is written under a temporary name and renamed (files.atomic_write), then recorded in
``.parts/shard-N.json`` with a fingerprint of what it holds (sample names, targets, encoding
options). A second run removes the temporary files a killed run left, skips every shard whose record
matches and whose file has the recorded size, rewrites the others, and writes index.json last. Tar
headers carry fixed times and owners (webdataset's TarWriter with mtime 0), so a shard's bytes
depend on its samples alone, and the shuffle is a function of the seed and the sample names alone:
an interrupted run, run again, produces the same shards as an uninterrupted one.

An object-store output (s3://, gs://, az://) is packed into a local staging folder first, then
``publish_split`` uploads it: each shard followed by its ``.parts`` record, the index last. A run
again uploads only the shards whose record in the bucket differs from the staged one, so an
interrupted upload resumes, and readers never see an index naming a shard not yet there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image

from distribuuuu.data.annotations import AnnotationSpec, Target
from distribuuuu.data.datasets import DataError
from distribuuuu.data.errors import import_extra
from distribuuuu.data.packed import INDEX, KIND, key_of, md5_of
from distribuuuu.data.readers import build_base_dataset
from distribuuuu.data.remote import join, read_bytes, upload
from distribuuuu.files import PART, atomic_write

SHARD = "shard-{:06d}.tar"
PARTS = ".parts"


@dataclass(frozen=True)
class PackOptions:
    shard_size: int = 1000  # samples per shard
    max_side: int = 0  # re-encode as JPEG with the longer side at most this (0: keep the size)
    quality: int = 0  # JPEG quality when re-encoding (0: store the original bytes unless max_side)
    shuffle_seed: int | None = 0  # samples shuffled across shards with this seed (None: the dataset's order)


@dataclass
class PackReport:
    shards: int
    written: int  # shards (re)written by this run; the rest were already there
    samples: int


def _source(base, folder: str) -> tuple[list[tuple[str, int]], Callable[[int], tuple[bytes, str]]]:
    """The split's (name, target) list and a reader of sample i's (encoded bytes, extension)."""
    if hasattr(base, "samples"):  # ImageFolder or an annotation file: the files as they are
        names = [(os.path.relpath(path, folder), t) for path, t in base.samples]

        def read(i: int) -> tuple[bytes, str]:
            path = base.samples[i][0]
            with open(path, "rb") as f:
                ext = os.path.splitext(path)[1].lower().lstrip(".")
                return f.read(), "jpg" if ext == "jpeg" else ext

        return names, read
    targets = [int(t) for t in base.targets]  # CIFAR: uint8 arrays, stored as PNG

    def read_array(i: int) -> tuple[bytes, str]:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(base.data[i])).save(buf, "PNG")
        return buf.getvalue(), "png"

    return [(f"{i:06d}.png", t) for i, t in enumerate(targets)], read_array


def packing_order(names: list[tuple[str, int]], seed: int | None) -> list[int]:
    """The dataset's sample indices in the order they go to the shards: shuffled by ``seed``, or as they are.

    Sorted by a SHA-256 of (seed, name) rather than drawn from a seeded generator: neither NumPy nor
    torch nor Python's random promises the same stream across releases, and resuming a pack needs the
    same order on any version. It also depends on the names alone, not on how the source lists them.
    """
    if seed is None:
        return list(range(len(names)))
    return sorted(range(len(names)), key=lambda i: hashlib.sha256(f"{seed}/{names[i][0]}".encode()).digest())


def reencode(data: bytes, opts: PackOptions) -> tuple[bytes, str]:
    """JPEG at ``quality`` (90 if unset), the longer side shrunk to ``max_side`` (never enlarged)."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
        if opts.max_side and max(img.size) > opts.max_side:
            scale = opts.max_side / max(img.size)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=opts.quality or 90)
        return buf.getvalue(), "jpg"


def pack_split(
    root: str,
    split: str,
    out: str,
    opts: PackOptions,
    progress: Callable[[int, int], None] = lambda done, total: None,
    annotations: AnnotationSpec | None = None,
) -> PackReport:
    """Pack ``root``/``split`` (an ImageFolder root or "cifar10:<root>"), or the images ``annotations``
    lists under ``root``, into ``out``/``split``; the index carries each sample's target(s)."""
    webdataset = import_extra("webdataset", f"packing {root}", "data")

    base, classes = build_base_dataset(root, split, "pil", annotations=annotations)
    source_names, read = _source(base, root if annotations else os.path.join(root, split))
    order = packing_order(source_names, opts.shuffle_seed)  # row r holds the dataset's sample order[r]
    names = [source_names[i] for i in order]
    folder = os.path.join(out, split)
    os.makedirs(os.path.join(folder, PARTS), exist_ok=True)
    _remove_temporaries(folder)
    starts = range(0, len(names), opts.shard_size)
    shardlist, written = [], 0
    for n, start in enumerate(starts):
        rows = range(start, min(start + opts.shard_size, len(names)))
        fingerprint = hashlib.sha256(json.dumps([asdict(opts), [names[r] for r in rows]]).encode()).hexdigest()
        path, record_path = os.path.join(folder, SHARD.format(n)), os.path.join(folder, PARTS, f"{n:06d}.json")
        record = _read_record(record_path)
        if not (record and record["fingerprint"] == fingerprint and _size(path) == record["filesize"]):
            with atomic_write(path) as f, webdataset.TarWriter(f, user="", group="", mtime=0, encoder=False) as tar:
                for r in rows:
                    data, ext = read(order[r])
                    if opts.max_side or opts.quality:
                        data, ext = reencode(data, opts)
                    tar.write({"__key__": key_of(r), ext: data, "cls": _cls(names[r][1]).encode()})
            record = {"fingerprint": fingerprint, "filesize": _size(path), "md5sum": md5_of(path)}
            _write_json(record_path, record)
            written += 1
        shardlist.append(
            {"url": SHARD.format(n), "nsamples": len(rows), **{k: record[k] for k in ("filesize", "md5sum")}}
        )
        progress(n + 1, len(starts))
    index = {
        "__kind__": KIND,
        "wids_version": 1,
        "name": f"{os.path.basename(os.path.normpath(root.split(':')[-1]))}/{split}",
        "packing": asdict(opts),
        "classes": list(classes),
        "samples": [[name, target] for name, target in names],
        "shardlist": shardlist,
    }
    _write_json(os.path.join(folder, INDEX), index)
    return PackReport(len(starts), written, len(names))


def _cls(target: Target) -> str:
    """A sample's ``.cls`` entry: its class index, or a multi-label sample's indices joined by commas."""
    return ",".join(map(str, target)) if isinstance(target, tuple) else str(target)


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.isfile(path) else -1


def _read_record(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # absent or half-written: the shard is packed again


def _write_json(path: str, obj: dict) -> None:
    with atomic_write(path, "w") as f:
        json.dump(obj, f)


def _remove_temporaries(folder: str) -> None:
    """Remove the temporary files a killed run left behind (a finished write renames its own away)."""
    for where in (folder, os.path.join(folder, PARTS)):
        for name in os.listdir(where):
            if name.endswith(PART):
                os.unlink(os.path.join(where, name))


def publish_split(folder: str, url: str) -> int:
    """Upload the packed split ``folder`` to the object-store folder ``url``; the number of shards uploaded."""
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    uploaded = 0
    for n, shard in enumerate(index["shardlist"]):
        record = os.path.join(folder, PARTS, f"{n:06d}.json")
        with open(record, "rb") as f:
            staged = f.read()
        if _read_remote(join(url, f"{PARTS}/{n:06d}.json")) != staged:  # absent, or another packing
            upload(os.path.join(folder, shard["url"]), join(url, shard["url"]))
            upload(record, join(url, f"{PARTS}/{n:06d}.json"))  # after its shard: it vouches for it
            uploaded += 1
    upload(os.path.join(folder, INDEX), join(url, INDEX))
    return uploaded


def _read_remote(url: str) -> bytes | None:
    try:
        return read_bytes(url)
    except DataError:
        return None  # not there (yet): the shard is uploaded


def verify_split(folder: str) -> list[str]:
    """The shards of a packed split whose size or MD5 differs from its index (empty: all good)."""
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    bad = []
    for s in index["shardlist"]:
        path = os.path.join(folder, s["url"])
        if _size(path) != s["filesize"] or md5_of(path) != s["md5sum"]:
            bad.append(path)
    return bad
