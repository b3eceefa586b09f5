"""A profiler trace of 20 steady training steps (after ``--warmup`` steps, where compiling and the
workers' start happen): the trainer's train_step on the train loader's batches. Writes the chrome
trace, gzipped (chrome://tracing and Perfetto open it), and the kernels by device time.

    python -m benchmarks.trace --out DIR --steps 20 --warmup 15 TRAIN.DATASET PHOTOS DATA.DECODER batched ...
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys

import torch

from benchmarks.common import emit, environment, guarded, parser, synchronize, timed
from distribuuuu import trainer
from distribuuuu.config import load_cfg
from distribuuuu.records.meters import MetricSums


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__)
    args.add_argument("--out", required=True, help="folder for trace.json.gz and kernels.txt")
    args.add_argument("--steps", type=int, default=20)
    args.add_argument("--warmup", type=int, default=15)
    parsed = args.parse_args(argv)
    env = environment()
    cfg = load_cfg(None, parsed.opts)
    run = trainer.build_run(cfg, env)
    trainer.start_epoch_sampler(run, 0)  # the sampler at epoch 0, as train_epoch points it
    batches, sums = iter(run.train.loader), MetricSums(env.device, cfg.TRAIN.TOPK)
    for _ in range(parsed.warmup):
        trainer.train_step(run, [next(batches)], sums)
    synchronize(env.device)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if env.device.type == "cuda" else []
    )
    with torch.profiler.profile(activities=activities) as prof, timed(env.device) as seconds:
        for _ in range(parsed.steps):
            trainer.train_step(run, [next(batches)], sums)
    os.makedirs(parsed.out, exist_ok=True)
    trace = os.path.join(parsed.out, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(trace)
    sort = "cuda_time_total" if env.device.type == "cuda" else "cpu_time_total"
    with open(os.path.join(parsed.out, "kernels.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40))
    images = parsed.steps * cfg.TRAIN.BATCH_SIZE
    emit({"what": "trace", "steps": parsed.steps, "img_per_s_profiled": round(images / seconds(), 1),
          "trace": trace + ".gz", "device": str(env.device)}, parsed.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
