"""Pack an ImageFolder, CIFAR or annotation-file dataset into WebDataset shards that distribuuuu reads as TRAIN.DATASET.

    python tools/pack_dataset.py SRC OUT [--splits train,val] [--shard-size 1000]
                                 [--max-side 0] [--quality 0] [--shuffle-seed 0 | --no-shuffle] [--verify]
                                 [--ann-files train.csv,val.csv [--ann-header] [--ann-classes FILE] [--label-sep " "]]

SRC is an ImageFolder root (SRC/<split>/<class>/<image>) or "cifar10:<root>" / "cifar100:<root>".
With --ann-files, each split is the annotation file in the same place of that list (relative to SRC
unless absolute; docs/annotations.md), its images relative to SRC: the index carries each sample's
target(s) and the classes (--ann-classes, a file of names relative to SRC, else the labels found);
--label-sep makes them multi-label (the label field's class names joined by it; MODEL.TASK multilabel).
OUT/<split>/ receives shard-NNNNNN.tar and index.json; serve OUT over HTTP(S) and use its URL
as TRAIN.DATASET to read it remotely. OUT may be an object store (s3://bucket/x, gs://, az://;
the cloud extra): the splits are packed into --staging, then uploaded, the index last.
A run interrupted half-way resumes: run it again.
Samples are shuffled across shards (seed --shuffle-seed, 0 by default; the same seed gives the
same shards), so each shard holds a mix of the classes, which DATA.SHUFFLE_WINDOW needs;
--no-shuffle keeps the source's order (ImageFolder's: class by class).
--max-side / --quality re-encode every image as JPEG (the longer side at most --max-side):
smaller shards and faster decoding, at a pixel cost (docs/design.md). --verify checks
every shard's size and MD5 against the index and packs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.data import DataError  # noqa: E402
from distribuuuu.data.annotations import AnnotationSpec  # noqa: E402
from distribuuuu.data.pack import PackOptions, pack_split, publish_split, verify_split  # noqa: E402
from distribuuuu.data.remote import is_remote, join  # noqa: E402
from distribuuuu.errors import tool_error  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def progress_printer(split: str) -> callable:
    """A bar rewritten in place on a terminal; one line per 10% otherwise (logs stay short)."""
    tty, tic = sys.stdout.isatty(), time.perf_counter()

    def show(done: int, total: int) -> None:
        bar = "#" * (24 * done // total)
        line = f"{split}: [{bar:<24}] {done}/{total} shards  {time.perf_counter() - tic:.0f}s"
        if tty:
            print("\r" + line, end="\n" if done == total else "", flush=True)
        elif done == total or done * 10 // total != (done - 1) * 10 // total:
            print(line, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="ImageFolder root, or cifar10:<root> / cifar100:<root>")
    p.add_argument("out", help="output folder (OUT/<split>/index.json and shards)")
    p.add_argument("--splits", default="train,val", help="comma-separated split folders")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    p.add_argument("--max-side", type=int, default=0, help="re-encode as JPEG, longer side at most this")
    p.add_argument("--quality", type=int, default=0, help="JPEG quality when re-encoding (default 90)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--shuffle-seed", type=int, default=0, help="seed of the shuffle across shards (default 0)")
    order.add_argument("--no-shuffle", action="store_true", help="keep the source's order (class by class)")
    p.add_argument("--verify", action="store_true", help="check OUT's shards against their index; pack nothing")
    p.add_argument(
        "--ann-files", default="", help="comma-separated annotation files, one per split (docs/annotations.md)"
    )
    p.add_argument("--ann-header", action="store_true", help="the annotation files' first line is a header")
    p.add_argument("--ann-classes", default="", help="file of class names, one a line, relative to SRC")
    p.add_argument("--label-sep", default="", help="multi-label annotation files: the class names' separator")
    p.add_argument("--staging", default="", help="local folder an object-store OUT is packed in (default: a temp dir)")
    a = p.parse_args(argv)
    if a.shard_size < 1 or a.max_side < 0 or not 0 <= a.quality <= 100:
        p.error("--shard-size must be >= 1, --max-side >= 0, --quality in 0..100")
    if is_remote(a.out) and a.verify:
        p.error("--verify reads a local OUT (a bucket's shards are checked as they are downloaded)")
    if a.shuffle_seed < 0:
        p.error(f"--shuffle-seed must be >= 0, got {a.shuffle_seed} (--no-shuffle keeps the source's order)")
    splits = [s for s in a.splits.split(",") if s]
    ann_files = [f for f in a.ann_files.split(",") if f]
    if ann_files and len(ann_files) != len(splits):
        p.error(f"--ann-files names {len(ann_files)} file(s) for {len(splits)} split(s) ({','.join(splits)})")
    classes = os.path.join(a.src, a.ann_classes) if a.ann_classes else ""
    annotations = [AnnotationSpec(f, a.ann_header, classes, a.label_sep) for f in ann_files] or [None] * len(splits)
    try:
        if a.verify:
            bad = [b for s in splits for b in verify_split(os.path.join(a.out, s))]
            print("\n".join(f"bad shard: {b}" for b in bad) or "every shard matches its index")
            return 1 if bad else 0
        opts = PackOptions(a.shard_size, a.max_side, a.quality, None if a.no_shuffle else a.shuffle_seed)
        pack(a.src, list(zip(splits, annotations)), a.out, opts, a.staging)
    except (DataError, OSError) as e:
        return tool_error(PROG, e)
    return 0


def pack(src: str, splits: list[tuple[str, AnnotationSpec | None]], out: str, opts: PackOptions, staging: str) -> None:
    """Pack each split (read from its annotation file, if any) into ``out``; an object-store ``out``
    through the local ``staging`` folder."""
    local = out
    if is_remote(out):
        # Kept until every split is uploaded: a run again resumes from it (packs and uploads only what is missing).
        local = staging or os.path.join(
            tempfile.gettempdir(), "distribuuuu-pack", hashlib.sha256(out.encode()).hexdigest()[:16]
        )
    for split, spec in splits:
        r = pack_split(src, split, local, opts, progress_printer(split), spec)
        print(f"{split}: {r.samples} samples in {r.shards} shards ({r.written} written, {r.shards - r.written} kept)")
        if local != out:
            uploaded = publish_split(os.path.join(local, split), join(out, split))
            print(f"{split}: {uploaded} shards uploaded to {join(out, split)}, {r.shards - uploaded} already there")
    if local != out and not staging:
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
