"""Train the quick start's settings (data/digits, resnet18 at 32 px, one process, batch 32, 10
epochs) with each candidate change of the defaults, over several seeds, and print final and best
val top-1 per candidate: the table in docs/recipe.md ("Defaults").

    python docs/scripts/compare_defaults.py [--seeds 1 2 3] [--only NAME ...] [--out /tmp/defaults]

Each run is ``tools/train_net.py`` in its own process and OUT_DIR, one process on one thread (so
the result does not depend on how a machine's cores are shared, and two runs may share 2 cores);
runs whose OUT_DIR already holds a finished run are read, not trained again, so the script can be
stopped and started again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.environ.get("DISTRIBUUUU_ROOT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def both_keys(zero_init: bool, smoothing: float) -> list[str]:
    """Overrides naming both keys the comparison changed, so the table reads the same whatever today's defaults."""
    return ["MODEL.ZERO_INIT_RESIDUAL", str(zero_init), "TRAIN.LABEL_SMOOTHING", str(smoothing)]


# name -> config overrides
CANDIDATES = {
    "before (no zero-init, no smoothing)": both_keys(False, 0.0),
    "zero-init residual": both_keys(True, 0.0),
    "label smoothing 0.1": both_keys(False, 0.1),
    "zero-init + smoothing 0.1 (today's defaults)": both_keys(True, 0.1),
    "before + precise BN 1436": both_keys(False, 0.0) + ["BN.PRECISE_IMAGES", "1436"],
}


def metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def val_top1(out_dir: str) -> list[float]:
    """Each epoch's val top-1 (the raw weights'), in epoch order."""
    return [r["top1"] for r in metrics(out_dir) if r.get("split") == "val" and "top1" in r]


def train(name: str, seed: int, out: str, epochs: int) -> list[float]:
    out_dir = os.path.join(out, f"{re.sub(r'[^a-z0-9.]+', '_', name.lower()).strip('_')}_s{seed}")
    if len(val_top1(out_dir)) < epochs:
        cmd = [sys.executable, os.path.join(ROOT, "tools", "train_net.py"), "OUT_DIR", out_dir, "RNG_SEED", str(seed)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd + CANDIDATES[name], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return val_top1(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--only", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--out", default="/tmp/distribuuuu-defaults")
    parser.add_argument("--epochs", type=int, default=10, help="the defaults' OPTIM.MAX_EPOCH")
    args = parser.parse_args()
    print("| candidate | final top-1 per seed | mean final | mean best | epoch 1 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.only:
        runs = [train(name, seed, args.out, args.epochs) for seed in args.seeds]
        finals, bests, firsts = [r[-1] for r in runs], [max(r) for r in runs], [r[0] for r in runs]
        per_seed = ", ".join(f"{v:.2f}" for v in finals)
        print(
            f"| {name} | {per_seed} | {statistics.mean(finals):.2f} | {statistics.mean(bests):.2f} "
            f"| {statistics.mean(firsts):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
