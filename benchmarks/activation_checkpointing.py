"""What MODEL.ACTIVATION_CHECKPOINTING saves and costs on the CPU: for each model and mode, the bytes of
activations autograd keeps for backward, the peak RSS of training above the process's RSS before it,
and img/s.

    OMP_NUM_THREADS=1 python benchmarks/activation_checkpointing.py [--archs resnet18 vit_tiny] \
        [--size 64] [--batch 32] [--steps 3] [--repeats 2]

Each (model, mode) trains in a fresh process (peak RSS is a process's high-water mark), the modes
alternated over ``--repeats`` rounds; the table has the median img/s and the largest peak. Models are
built by ``distribuuuu.models.build_model``, the trainer's, and checkpointed by it; SGD with momentum,
fp32, random images.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCHS = {  # name -> (MODEL.ARCH, constructor keywords at --size)
    "resnet18": ("resnet18", lambda size: {}),
    "vit_tiny": ("vit_tiny_patch16_224", lambda size: {"img_size": size, "patch_size": 8}),  # timm; 12 blocks
    "vit_b_16": ("vit_b_16", lambda size: {"image_size": size}),  # torchvision
}
MODES = [("none", 1), ("selective", 2), ("full", 1)]


def rss_kib(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its high-water mark (VmHWM), in KiB, from /proc."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def saved_bytes(model, images, targets) -> int:
    """Bytes of activations autograd keeps for one backward pass: the distinct tensors it saves, less the
    parameters (saved by reference, no memory of their own); a checkpointed block keeps only its input."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}  # storage -> bytes: views of one storage count once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(images), targets)
    loss.backward()
    return sum(kept.values())


def measure(arch: str, mode: str, every: int, size: int, batch: int, steps: int) -> dict:
    """Train ``steps`` steps after one warm-up step; return saved bytes, peak RSS growth and img/s."""
    import torch

    from distribuuuu.models import build_model

    name, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    model = build_model(name, 10, kwargs(size), None, True, mode, every).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, targets = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    before = rss_kib()
    kept = saved_bytes(model, images, targets)  # the warm-up step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tic = time.perf_counter()
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - tic
    peak = max(rss_kib("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {
        "saved_mib": kept / 2**20,
        "peak_above_start_mib": (peak - before) / 1024,
        "images_per_s": steps * batch / seconds,
    }


def run_one(args: argparse.Namespace, arch: str, mode: str, every: int) -> dict:
    cmd = [sys.executable, __file__, "--one", arch, mode, str(every), "--size", str(args.size)]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(args: argparse.Namespace) -> None:
    print(
        f"| model ({args.size} px, batch {args.batch}) | mode | kept for backward | peak RSS above start | img/s | vs none |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for arch in args.archs:
        rounds = [{f"{m}:{e}": run_one(args, arch, m, e) for m, e in MODES} for _ in range(args.repeats)]
        speed = {k: statistics.median(r[k]["images_per_s"] for r in rounds) for k in rounds[0]}
        for key in rounds[0]:
            mode, every = key.split(":")
            label = f"selective, every {every}" if mode == "selective" else mode
            peak = max(r[key]["peak_above_start_mib"] for r in rounds)
            print(
                f"| {arch} | {label} | {rounds[0][key]['saved_mib']:.0f} MiB | {peak:.0f} MiB "
                f"| {speed[key]:.1f} | {speed[key] / speed['none:1']:.2f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", choices=list(ARCHS), default=["resnet18", "vit_tiny"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=3, metavar=("ARCH", "MODE", "EVERY"), help="measure one (the workers)")
    args = parser.parse_args()
    if args.one:
        arch, mode, every = args.one
        print(json.dumps(measure(arch, mode, int(every), args.size, args.batch, args.steps)))
    else:
        table(args)


if __name__ == "__main__":
    main()
