"""Synthetic photo folders for the measurements: smooth random images saved as JPEGs (quality 90),
an ImageFolder of two classes (train and val), each unique photo hard-linked ``copies`` times so
that decoding costs what it costs while the disk holds few; optionally one CMYK JPEG in every
``cmyk_every`` files of train.

    python -m benchmarks.photos ROOT --photos 1024 --copies 12 [--size 375x500] [--cmyk-every 256] [--val 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from PIL import Image

from benchmarks.common import guarded


def photo(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    """A smooth random RGB image (JPEG keeps it close, as it does a photo)."""
    small = rng.integers(0, 256, (max(height // 16, 2), max(width // 16, 2), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


def make_photos(
    root: str, photos: int, size: tuple[int, int], copies: int = 1, cmyk_every: int = 0, val: int = 0
) -> int:
    """Write the folder (both orientations of ``size``, alternately); return the train files written."""
    rng = np.random.default_rng(0)
    written = 0
    for split, count in (("train", photos), ("val", val or max(photos // 8, 2))):
        for i in range(count):
            cls = os.path.join(root, split, f"c{i % 2}")
            os.makedirs(cls, exist_ok=True)
            height, width = size if i % 2 else size[::-1]
            path = os.path.join(cls, f"p{i}.jpg")
            photo(rng, height, width).save(path, quality=90)
            for k in range(1, copies if split == "train" else 1):
                os.link(path, os.path.join(cls, f"p{i}_{k}.jpg"))
            written += copies if split == "train" else 0
    if cmyk_every:
        add_cmyk(os.path.join(root, "train"), cmyk_every, written)
    return written


def add_cmyk(train: str, every: int, files: int) -> None:
    """Rewrite one train file in every ``every`` as a CMYK JPEG (its hard links first broken)."""
    paths = sorted(os.path.join(d, f) for d, _, names in os.walk(train) for f in names)
    for path in paths[:: max(every, 1)][: max(files // every, 1)]:
        image = Image.open(path).convert("CMYK")
        os.unlink(path)
        image.save(path, quality=90)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("root")
    args.add_argument("--photos", type=int, default=1024)
    args.add_argument("--copies", type=int, default=1)
    args.add_argument("--size", default="375x500", help="HEIGHTxWIDTH of the landscape photos")
    args.add_argument("--cmyk-every", type=int, default=0)
    args.add_argument("--val", type=int, default=0, help="val photos (0: an eighth of --photos)")
    parsed = args.parse_args(argv)
    height, width = map(int, parsed.size.split("x"))
    written = make_photos(parsed.root, parsed.photos, (height, width), parsed.copies, parsed.cmyk_every, parsed.val)
    print(f"photos: {written} train files ({parsed.photos} unique, {height}x{width}) under {parsed.root}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
