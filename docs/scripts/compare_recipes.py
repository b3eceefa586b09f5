"""Train the digits with each recipe of the cluster features (repeated augmentation, 3-Augment, Muon)
and its baseline over several seeds, evaluate the final weights with and without flip TTA, and print
the table in docs/recipe.md ("Recipes on the digits").

    python docs/scripts/compare_recipes.py [--seeds 1 2 3] [--only NAME ...] [--out /tmp/recipes]

Each run is ``tools/train_net.py`` in its own process and OUT_DIR on one thread, one run after the
other; TTA is ``tools/test_net.py`` on the run's last checkpoint with ``TEST.TTA flip`` (into
OUT_DIR_tta). Runs whose OUT_DIR already holds a finished run are read, not trained again, so the
script can be stopped and started again.
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
# The quick start's settings at 16 px (a quarter of the pixels: an epoch in 13-18 s of one shared core).
SMALL = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "LOG.PLOT", "False"]
# A 4-block timm ViT-Tiny on 4 x 4 patches of the 16 px digits (16 tokens and a class token), AdamW's recipe.
VIT = SMALL + [
    "MODEL.ARCH", "vit_tiny_patch16_224", "MODEL.KWARGS", "['img_size=16', 'patch_size=4', 'depth=4']",
    "OPTIM.BASE_LR", "0.001", "OPTIM.WEIGHT_DECAY", "0.05",
]  # fmt: skip

# name -> config overrides; the baseline of each is the first row of its group
CANDIDATES = {
    "resnet18, defaults": SMALL,
    "resnet18, repeated augmentation x3": SMALL + ["TRAIN.SAMPLER", "repeated", "TRAIN.REPEATED_AUG", "3"],
    "resnet18, 3-Augment (jitter 0.3)": SMALL + ["DATA.AUTO_AUGMENT", "threeaugment", "DATA.COLOR_JITTER", "0.3"],
    # flip TTA averages two views the model was trained on only if training flips too
    "resnet18, flips in training (HFLIP 0.5)": SMALL + ["DATA.HFLIP_PROB", "0.5"],
    "ViT-Tiny/4 x4 blocks, AdamW": VIT + ["OPTIM.OPTIMIZER", "adamw"],
    "ViT-Tiny/4 x4 blocks, Muon + AdamW": VIT + ["OPTIM.OPTIMIZER", "muon"],
}


def records(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def val_top1(out_dir: str) -> list[float]:
    """Each epoch's val top-1 (the raw weights'), in epoch order."""
    return [r["top1"] for r in records(out_dir) if r.get("split") == "val"]


def run(tool: str, opts: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "tools", tool), *opts]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def train(name: str, seed: int, out: str, epochs: int) -> tuple[list[float], float, float]:
    """The run's val top-1 by epoch, its training time (s), and its last weights' top-1 with flip TTA."""
    out_dir = os.path.join(out, f"{re.sub(r'[^a-z0-9.]+', '_', name.lower()).strip('_')}_s{seed}")
    if len(val_top1(out_dir)) < epochs:
        run(
            "train_net.py",
            ["OUT_DIR", out_dir, "RNG_SEED", str(seed), "OPTIM.MAX_EPOCH", str(epochs), *CANDIDATES[name]],
        )
    tta_dir = out_dir + "_tta"
    if not records(tta_dir):
        weights = os.path.join(out_dir, "checkpoints", f"ckpt_ep_{epochs:03d}.pth.tar")
        run("test_net.py", ["MODEL.WEIGHTS", weights, "TEST.TTA", "flip", "OUT_DIR", tta_dir, "LOG.PLOT", "False"])
    train_s = sum(r["time_s"] for r in records(out_dir) if r.get("split") == "train")
    return val_top1(out_dir), train_s, records(tta_dir)[-1]["top1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--only", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--out", default="/tmp/distribuuuu-recipes")
    parser.add_argument("--epochs", type=int, default=10, help="OPTIM.MAX_EPOCH of every run")
    args = parser.parse_args()
    print("| recipe | final top-1 per seed | mean final | mean best | flip TTA, mean | train s / run |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in args.only:
        runs = [train(name, seed, args.out, args.epochs) for seed in args.seeds]
        finals, bests = [r[0][-1] for r in runs], [max(r[0]) for r in runs]
        per_seed = ", ".join(f"{v:.2f}" for v in finals)
        print(
            f"| {name} | {per_seed} | {statistics.mean(finals):.2f} | {statistics.mean(bests):.2f} "
            f"| {statistics.mean(r[2] for r in runs):.2f} | {statistics.mean(r[1] for r in runs):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
