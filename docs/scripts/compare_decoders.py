"""Decode the same JPEGs with PIL, PIL at reduced DCT scale (draft), torchvision.io and TorchCodec,
one image at a time on one core, decoders in turn within each repetition; then torchvision.io and
TorchCodec on lists of 32 (DATA.DECODER batched's call, here on the CPU). Three sets of files:
data/digits re-saved as JPEG (quality 90), 500x375 photos and ImageNet-like mixed sizes
(tools/benchmark.py's synthetic photos).

    OMP_NUM_THREADS=1 python docs/scripts/compare_decoders.py [N] [REPEATS]

The figures are in docs/performance.md and docs/design.md. TorchCodec is optional
(``pip install torchcodec``, or distribuuuu's ``codec`` extra); without it its rows are left out.
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


def digits_as_jpeg(root: str, n: int) -> list[str]:
    """The first ``n`` images of data/digits, re-saved as JPEG (quality 90)."""
    digits = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "digits", "train")
    pngs = sorted(os.path.join(d, f) for d, _, fs in os.walk(digits) for f in fs if f.endswith(".png"))[:n]
    files = []
    for i, png in enumerate(pngs):
        files.append(os.path.join(root, f"{i:05d}.jpg"))
        Image.open(png).convert("RGB").save(files[-1], quality=90)
    return files


def photo_files(n: int, mixed: bool) -> list[str]:
    photos = make_photo_folder(tempfile.mkdtemp(prefix="decoders-"), n, mixed=mixed)
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(photos, "train")) for f in fs)


def compare(label: str, files: list[str], repeats: int) -> None:
    blobs = [open(f, "rb").read() for f in files]
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    batches = [tensors[i : i + 32] for i in range(0, len(tensors), 32)]
    rgb = torchvision.io.ImageReadMode.RGB
    decoders = {
        "PIL": lambda: [pil(b) for b in blobs],
        "PIL draft 1/2": lambda: [pil_draft_half(b) for b in blobs],
        "torchvision.io": lambda: [torchvision.io.decode_jpeg(t, mode=rgb) for t in tensors],
        "torchvision.io, lists of 32": lambda: [torchvision.io.decode_jpeg(b, mode=rgb) for b in batches],
    }
    try:
        from torchcodec.decoders import decode_jpeg

        decoders["torchcodec"] = lambda: [decode_jpeg(t, mode="RGB") for t in tensors]
        decoders["torchcodec, lists of 32"] = lambda: [decode_jpeg(b, mode="RGB") for b in batches]
    except ImportError as e:
        print(f"torchcodec: not installed ({e})")
    rates = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, decode in decoders.items():
            tic = time.perf_counter()
            decode()
            rates[name].append(len(files) / (time.perf_counter() - tic))
    print(f"{label}, {len(files)} files:")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<28} median {median:8.1f} img/s  (min {min(values):.1f}, max {max(values):.1f})")


def main() -> None:
    n, repeats = (int(a) for a in (sys.argv[1:] + ["400", "3"])[:2])
    torch.set_num_threads(1)
    compare("data/digits as JPEG q90", digits_as_jpeg(tempfile.mkdtemp(prefix="digits-"), n), repeats)
    compare("500x375 photos q90", photo_files(n, mixed=False), repeats)
    compare("mixed-size photos q90", photo_files(n, mixed=True), repeats)


if __name__ == "__main__":
    main()
