"""The model's own ceiling: the trainer's training step (forward, backward, optimizer step, metrics)
on one batch resident on the device, no loader, timed by CUDA events (the host clock on a CPU),
for each batch size; compiled when TRAIN.COMPILE says so.

    python -m benchmarks.ceiling --batches 256,512 --steps 30 --warmup 10 MODEL.ARCH resnet50 \\
        TRAIN.IM_SIZE 224 TRAIN.PRECISION bf16 TRAIN.CHANNELS_LAST True TRAIN.COMPILE True

Each batch size builds its run afresh (torch._dynamo reset: graphs of its own size, not one
generic in the batch). What the JPEG path reaches (benchmarks.epochs) is read against this.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.common import emit, environment, guarded, parser, peak_gib, reset_peak, synchronize, timed
from distribuuuu import trainer
from distribuuuu.config import load_cfg
from distribuuuu.records.meters import MetricSums


def resident_batch(cfg, device: torch.device) -> list:
    """One micro-batch of normalised images and targets already on the device."""
    g = torch.Generator().manual_seed(0)
    size, batch = cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE
    images = torch.randn(batch, 3, size, size, generator=g).to(device)
    targets = torch.randint(0, cfg.MODEL.NUM_CLASSES, (batch,), generator=g).to(device)
    return [(images, targets, 0)]


def measure(opts: list[str], batch: int, steps: int, warmup: int, env) -> dict:
    """img/s of ``steps`` training steps after ``warmup`` (where compiling happens), at ``batch``."""
    cfg = load_cfg(
        None, [*opts, "TRAIN.BATCH_SIZE", str(batch), "MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", str(batch)]
    )
    torch._dynamo.reset()
    run = trainer.build_run(cfg, env)
    micro_batch, sums = resident_batch(cfg, env.device), MetricSums(env.device, cfg.TRAIN.TOPK)
    with timed(env.device) as warm_s:
        for _ in range(warmup):
            trainer.train_step(run, micro_batch, sums)
    synchronize(env.device)
    reset_peak(env.device)
    with timed(env.device) as seconds:
        for _ in range(steps):
            trainer.train_step(run, micro_batch, sums)
    return {
        "what": "ceiling", "arch": cfg.MODEL.ARCH, "batch": batch, "im_size": cfg.TRAIN.IM_SIZE,
        "precision": cfg.TRAIN.PRECISION, "compile": cfg.TRAIN.COMPILE, "steps": steps,
        "img_per_s": round(batch * steps / seconds(), 1), "ms_per_step": round(1000 * seconds() / steps, 2),
        "warmup_s": round(warm_s(), 1), "peak_gib": round(peak_gib(env.device), 2), "device": str(env.device),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__)
    args.add_argument("--batches", default="256,512", help="comma-separated batch sizes")
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--warmup", type=int, default=10)
    parsed = args.parse_args(argv)
    env = environment()
    for batch in map(int, parsed.batches.split(",")):
        emit(measure(parsed.opts, batch, parsed.steps, parsed.warmup, env), parsed.json)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
