"""The batched resample alone on the device: what DATA.DECODER batched ships (two-term fp16
products, data/resample_matmul.py), the batch whole and in chunks of a budget, against the two
products' own cost in fp32, TF32, bf16 and fp16 (one term) on the same shapes.

    python -m benchmarks.resample --batch 256 --sizes 375x500,3000x4000 --budget-gib 7 --repeats 10

Images are random uint8 pixels already on the device (what the decoder hands over), crops drawn as
the workers draw them (RandomResizedCrop(224), scale 0.08-1, flip 0.5), orientations mixed. TF32
is switched on for this process only while its products run (no model beside them here).
"""

from __future__ import annotations

import sys

import torch
from torchvision.transforms import v2

from benchmarks.common import emit, environment, guarded, parser, peak_gib, reset_peak, synchronize, timed
from distribuuuu.data.datasets import seeded_cpu_rng
from distribuuuu.data.resample import TrainGeometry
from distribuuuu.data.resample_matmul import OutputFormat, resample_batched, size_groups

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def batch_of(size: tuple[int, int], batch: int, out: int, device: torch.device) -> tuple[list, torch.Tensor]:
    """``batch`` random images of ``size`` (every other one turned), on the device, and their plans."""
    g = torch.Generator(device=device).manual_seed(0)  # drawn on the device: 256 photos of 12 MP are 9 GB
    shapes = [size if i % 2 else size[::-1] for i in range(batch)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g, device=device) for h, w in shapes]
    geometry = TrainGeometry(v2.RandomResizedCrop(out, scale=(0.08, 1.0), antialias=True), 0.5)
    with seeded_cpu_rng(0):
        plans = torch.stack([geometry.draw(h, w) for h, w in shapes])
    return images, plans


def time_it(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Milliseconds per call of ``fn`` (after one untimed call) and the peak GiB it allocated."""
    fn()
    synchronize(device)
    reset_peak(device)
    with timed(device) as seconds:
        for _ in range(repeats):
            fn()
    return 1000 * seconds() / repeats, peak_gib(device)


def products(images: list, plans: torch.Tensor, out: int, dtype: torch.dtype, device: torch.device):
    """The two products of the largest size group, one term each, in ``dtype``: a function to time,
    and their multiply-adds."""
    group = size_groups([tuple(p) for p in plans[:, [3, 7]].tolist()])[0]
    n, height, width = len(group), int(plans[group, 3].max()), int(plans[group, 7].max())
    g = torch.Generator(device=device).manual_seed(0)
    wy, crops = (
        torch.rand(n, a, b, device=device, generator=g, dtype=dtype) for a, b in ((out, height), (height, 3 * width))
    )
    wx = torch.rand(n, width, out, device=device, generator=g, dtype=dtype)

    def run():
        rows = torch.bmm(wy, crops).view(n, out * 3, width)
        return torch.bmm(rows, wx)

    return run, n * (out * height * 3 * width + out * 3 * width * out)


def shipped(images: list, plans: torch.Tensor, out: int, budget: int, repeats: int, device: torch.device) -> dict:
    """The shipped resample, normalised into channels_last, within ``budget`` bytes (0: whole)."""
    output = OutputFormat(MEAN, STD, channels_last=True)
    ms, peak = time_it(lambda: resample_batched(images, plans, (out, out), output, budget), device, repeats)
    mode = "two-term fp16, " + ("chunked" if budget else "whole")
    return {"what": "resample", "mode": mode, "budget_gib": round(budget / 2**30, 2), "ms": round(ms, 2),
            "img_per_s": round(1000 * len(images) / ms), "peak_gib": round(peak, 2)}  # fmt: skip


def one_term(images: list, plans: torch.Tensor, out: int, precision: str, repeats: int, device: torch.device) -> dict:
    """The two products alone, one term each, in ``precision``."""
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        run, macs = products(images, plans, out, dtype, device)
        ms, _ = time_it(run, device, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return {
        "what": "resample_products",
        "precision": precision,
        "ms": round(ms, 3),
        "tflop_per_s": round(2 * macs / ms / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__)
    args.add_argument("--batch", type=int, default=256)
    args.add_argument("--sizes", default="375x500,3000x4000", help="comma-separated HEIGHTxWIDTH")
    args.add_argument("--out", type=int, default=224)
    args.add_argument("--budget-gib", type=float, default=7.0, help="the chunked runs' budget")
    args.add_argument("--repeats", type=int, default=10)
    parsed = args.parse_args(argv)
    device = environment().device
    for size in [tuple(map(int, s.split("x"))) for s in parsed.sizes.split(",")]:
        images, plans = batch_of(size, parsed.batch, parsed.out, device)
        common = {"size": f"{size[0]}x{size[1]}", "batch": parsed.batch, "device": str(device)}
        for budget in (0, int(parsed.budget_gib * 2**30)):
            emit({**shipped(images, plans, parsed.out, budget, parsed.repeats, device), **common}, parsed.json)
        for precision in ("fp32", "tf32", "bf16", "fp16"):
            emit({**one_term(images, plans, parsed.out, precision, parsed.repeats, device), **common}, parsed.json)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
