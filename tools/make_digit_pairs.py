"""Build a multi-label dataset from the embedded digits: two digits side by side, labelled with both.

    python tools/make_digit_pairs.py OUT [--src data/digits] [--train 4000] [--val 1000] [--seed 0]

Each image pairs two digit images of the same split drawn at random (a 16 x 8 strip padded to
16 x 16 with black rows), and its label field names both classes, joined by a space (one class when
both digits are the same). OUT receives train/ and val/ PNGs and train.csv and val.csv with a header:
train with MODEL.TASK multilabel (docs/annotations.md, "Multi-label classification"). It prints the
figures of the trivial baseline a model must beat: every val image scored with the training label
frequencies, evaluated as training evaluates (distribuuuu.records.multilabel).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.errors import tool_error  # noqa: E402
from distribuuuu.records.multilabel import MultiLabelSums  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def digit_images(src: str, split: str) -> list[tuple[str, str]]:
    """(path, class) of every image of ``src``/``split``, in sorted order; OSError naming the folder
    if it holds none (or is missing)."""
    folder = os.path.join(src, split)
    classes = sorted(c for c in os.listdir(folder) if os.path.isdir(os.path.join(folder, c)))
    images = [
        (os.path.join(folder, c, f), c)
        for c in classes
        for f in sorted(os.listdir(os.path.join(folder, c)))
        if f.endswith(".png")
    ]
    if not images:
        raise OSError(f"no PNG digits in {folder}/<class>/ (--src: an ImageFolder root such as data/digits)")
    return images


def pair_image(left: str, right: str) -> Image.Image:
    """The two digits side by side, centred on a black square as wide as both."""
    a, b = (np.asarray(Image.open(p).convert("L")) for p in (left, right))
    strip = np.concatenate([a, b], axis=1)
    canvas = np.zeros((strip.shape[1], strip.shape[1]), dtype=np.uint8)
    top = (canvas.shape[0] - strip.shape[0]) // 2
    canvas[top : top + strip.shape[0]] = strip
    return Image.fromarray(canvas)


def make_split(src: str, out: str, split: str, count: int, rng: random.Random) -> list[set[int]]:
    """Write ``count`` pairs of ``split`` and its annotation file; return each image's classes."""
    images, labels = digit_images(src, split), []
    os.makedirs(os.path.join(out, split), exist_ok=True)
    with open(os.path.join(out, f"{split}.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "labels"])
        for i in range(count):
            (left, a), (right, b) = rng.choice(images), rng.choice(images)
            name = os.path.join(split, f"{i:06d}.png")
            pair_image(left, right).save(os.path.join(out, name))
            writer.writerow([name, " ".join(sorted({a, b}))])
            labels.append({int(a), int(b)})
    return labels


def frequency_baseline(train: list[set[int]], val: list[set[int]], num_classes: int = 10) -> dict[str, float]:
    """The val metrics of scoring every image with the training label frequencies."""
    sums = MultiLabelSums(num_classes, 4096, 0.5, torch.device("cpu"))
    targets = torch.tensor([[float(c in s) for c in range(num_classes)] for s in val])
    frequency = torch.tensor([sum(c in s for s in train) / len(train) for c in range(num_classes)])
    sums.add(torch.logit(frequency).expand(len(val), num_classes), targets)
    return sums.reduce()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output folder")
    p.add_argument("--src", default="data/digits", help="the digits ImageFolder root (default data/digits)")
    p.add_argument("--train", type=int, default=4000, help="training images (default 4000)")
    p.add_argument("--val", type=int, default=1000, help="validation images (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pairing (default 0)")
    a = p.parse_args(argv)
    if min(a.train, a.val) < 1:
        p.error(f"--train and --val must be >= 1, got {a.train} and {a.val}")
    rng = random.Random(a.seed)
    try:
        train, val = (make_split(a.src, a.out, s, count, rng) for s, count in (("train", a.train), ("val", a.val)))
    except OSError as e:  # a missing or empty --src, an OUT that cannot be written: one line
        return tool_error(PROG, e)
    print(f"{a.out}: {a.train} train and {a.val} val images of two digits, train.csv and val.csv")
    base = frequency_baseline(train, val)
    print(
        f"label-frequency baseline on val: mAP {base['map']:.2f}  F1 macro {base['f1_macro']:.2f}  micro {base['f1_micro']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
