"""Decode the same JPEGs with PIL, PIL at reduced DCT scale (draft), torchvision.io and TorchCodec,
one image at a time on one core, decoders in turn within each repetition.

    PYTHONPATH=<torchcodec install> OMP_NUM_THREADS=1 python docs/scripts/compare_decoders.py [N] [REPEATS]

The figures are in docs/packed-data.md. TorchCodec is not a dependency of distribuuuu: install it
apart (``pip install --target DIR --no-deps torchcodec``) and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time

import torch
import torchvision
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))

from benchmark import make_photo_folder  # noqa: E402


def pil(data: bytes):
    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


def pil_draft_half(data: bytes):
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (img.width // 2, img.height // 2))  # 1/2 scale: a quarter of the pixels
    return img.convert("RGB")


def main() -> None:
    n, repeats = (int(a) for a in (sys.argv[1:] + ["400", "3"])[:2])
    torch.set_num_threads(1)
    photos = make_photo_folder(tempfile.mkdtemp(prefix="decoders-"), n, mixed=True)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(photos, "train")) for f in fs)
    blobs = [open(f, "rb").read() for f in files]
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    decoders = {
        "PIL": lambda i: pil(blobs[i]),
        "PIL draft 1/2": lambda i: pil_draft_half(blobs[i]),
        "torchvision.io": lambda i: torchvision.io.decode_jpeg(tensors[i]),
    }
    try:
        from torchcodec.decoders import decode_jpeg

        decoders["torchcodec"] = lambda i: decode_jpeg(tensors[i])
    except ImportError as e:
        print(f"torchcodec: not installed ({e})")
    rates = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, decode in decoders.items():
            tic = time.perf_counter()
            for i in range(len(files)):
                decode(i)
            rates[name].append(len(files) / (time.perf_counter() - tic))
    for name, values in rates.items():
        print(
            f"{name:<15} median {statistics.median(values):8.1f} img/s  (min {min(values):.1f}, max {max(values):.1f})"
        )


if __name__ == "__main__":
    main()
