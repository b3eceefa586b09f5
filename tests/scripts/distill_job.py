"""Distil the tiny CNN from a teacher checkpoint under ddp, fsdp (teacher replicated) and fsdp with
DISTILL.SHARD_TEACHER, one after another in one torchrun job (start-up is the expensive part).

    torchrun --nproc_per_node=2 tests/scripts/distill_job.py REPORT.json ROOT TEACHER

Rank 0 writes, per strategy, the first and last epoch's training loss, the last val top-1, the
checkpoint and the teacher identity it holds to REPORT.json; the test holds the comparisons.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import models  # noqa: E402, F401  (registers the tiny CNN, tiny_cnn)

from distribuuuu import trainer  # noqa: E402
from distribuuuu.checkpointing import checkpoint as ckpt  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402
from distribuuuu.runtime.process_group import cleanup_distributed, is_main_process  # noqa: E402

RUN = ["MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.BATCH_SIZE", "32",
       "OPTIM.MAX_EPOCH", "3", "OPTIM.BASE_LR", "0.1", "TRAIN.PRINT_FREQ", "11", "LOG.PROGRESS", "False",
       "DATA.MIXUP_ALPHA", "0.2", "DISTILL.ALPHA", "0.5", "DISTILL.TEMPERATURE", "2.0"]  # fmt: skip
STRATEGIES = {
    "ddp": [],
    "fsdp": ["DIST.STRATEGY", "fsdp"],
    "fsdp_sharded": ["DIST.STRATEGY", "fsdp", "DISTILL.SHARD_TEACHER", "True"],
}


def main(report: str, root: str, teacher: str) -> None:
    results = {}
    for name, opts in STRATEGIES.items():
        out = os.path.join(root, name)
        val = trainer.train_model(
            load_cfg(None, [*RUN, *opts, "OUT_DIR", out, "DISTILL.TEACHER", teacher]), cleanup=False
        )
        if is_main_process():
            with open(os.path.join(out, "metrics.jsonl")) as f:
                train = [r for r in map(json.loads, f) if r.get("split") == "train"]
            path = str(ckpt.list_checkpoints(os.path.join(out, ckpt.CKPT_DIR), "any")[-1])
            results[name] = {
                "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"], "top1": val["top1_acc"],
                "checkpoint": path, "teacher": ckpt.load_checkpoint(path)["teacher"],
            }  # fmt: skip
    if is_main_process():
        with open(report, "w") as f:
            json.dump(results, f)
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
