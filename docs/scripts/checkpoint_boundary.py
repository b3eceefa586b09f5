"""How long a checkpoint stops training: a synchronous write against a background one (TRAIN.CKPT_ASYNC).

Builds a run as train_net.py does (one process, MODEL.DUMMY_INPUT), then alternates the two ways
of writing its checkpoint, each followed by the same training steps, and prints the medians:
the time the save call held training (the epoch boundary's checkpoint), and the time of the save
and the steps after it together (a background write shares the cores with those steps; what
is left of it then is not timed: the next checkpoint is an epoch away)::

    python docs/scripts/checkpoint_boundary.py [--repeats 5 --steps 5] [KEY VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from distribuuuu import trainer  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402
from distribuuuu.records.meters import MetricSums  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv  # noqa: E402
from distribuuuu.training import resume  # noqa: E402
from distribuuuu.training.run import build_run  # noqa: E402

DEFAULTS = ["MODEL.ARCH", "resnet18", "MODEL.DUMMY_INPUT", "True", "TRAIN.IM_SIZE", "32", "TRAIN.BATCH_SIZE", "64"]
DEFAULTS += ["DATA.DUMMY_SIZE", "640", "TRAIN.WORKERS", "0", "OPTIM.EMA_DECAY", "0.999"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="training steps after each save")
    parser.add_argument("opts", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-boundary-") as out:
        cfg = load_cfg(None, [*DEFAULTS, *args.opts, "OUT_DIR", out])
        os.makedirs(os.path.join(out, "checkpoints"))
        run = build_run(cfg, DistEnv())
        batches = [next(iter(run.train.loader)) for _ in range(args.steps)]
        sums = MetricSums(run.env.device, cfg.TRAIN.TOPK)
        checkpoints = resume.checkpointer(cfg)  # TRAIN.CKPT_ASYNC (the default): one background writer
        held: dict[str, list[float]] = {"sync": [], "background": []}
        with_steps: dict[str, list[float]] = {"sync": [], "background": []}
        for repeat in range(args.repeats + 1):  # the first round warms up, unrecorded
            for how in ("sync", "background") if repeat % 2 else ("background", "sync"):
                checkpoints.wait()
                start = time.perf_counter()
                resume.save_training_checkpoint(run, checkpoints, background=how == "background")
                saved = time.perf_counter()
                for batch in batches:
                    trainer.train_step(run, [batch], sums)
                sums.reduce()  # the steps' work is done (a GPU's queue drained)
                if repeat:
                    held[how].append(saved - start)
                    with_steps[how].append(time.perf_counter() - start)
                checkpoints.wait()  # outside the timing: the next save is an epoch away
        size = os.path.getsize(os.path.join(out, "checkpoints", os.listdir(os.path.join(out, "checkpoints"))[0]))
    print(f"{cfg.MODEL.ARCH}, checkpoint {size / 2**20:.1f} MiB, {args.repeats} alternated repeats, medians:")
    for how in held:
        print(
            f"  {how:10s} training held {statistics.median(held[how]):.3f} s; "
            f"save + {args.steps} steps {statistics.median(with_steps[how]):.3f} s"
        )


if __name__ == "__main__":
    main()
