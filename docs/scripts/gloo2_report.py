"""The gloo2 stage's verdict (docs/scripts/gpu_session.sh): python docs/scripts/gloo2_report.py WORK_DIR EPOCHS

WORK_DIR holds the stage's runs: ddp_straight (uninterrupted), ddp_resumed (SIGTERMed mid-epoch on
both ranks, then resumed), fsdp2 (its best.dcp read back by test_net.py on one rank). Prints the
digits' val top-1 by epoch, whether the two DDP runs' last checkpoints are bit-identical (model and
optimizer, state_checksum), and fsdp's logged best against test_net's top-1 from its best.dcp.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from distribuuuu.checkpointing import checkpoint as ckpt  # noqa: E402


def rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def val_top1(run_dir: str) -> list[float]:
    return [r["top1"] for r in rows(run_dir) if r["split"] == "val" and r.get("weights", "model") == "model"]


def compare_last_checkpoints(straight: str, resumed: str, epochs: int) -> str:
    a, b = (
        ckpt.load_checkpoint(os.path.join(d, ckpt.CKPT_DIR, ckpt.checkpoint_name(epochs))) for d in (straight, resumed)
    )
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    same = ckpt.state_checksum(a) == ckpt.state_checksum(b)  # SHA-256 over every model and optimizer tensor
    verdict = "bit-identical" if same else "DIFFERENT"
    return f"{verdict} ({len(differ)} of {len(a['model'])} model tensors differ; the checksum covers the optimizer too)"


def main(work_dir: str, epochs: int) -> None:
    straight, resumed, fsdp = (os.path.join(work_dir, d) for d in ("ddp_straight", "ddp_resumed", "fsdp2"))
    print(
        f"ddp over gloo, 2 ranks on one GPU, digits: val top-1 by epoch {val_top1(straight)}, resumed run {val_top1(resumed)}"
    )
    try:
        print(
            f"mid-epoch SIGTERM of both ranks + resume vs uninterrupted: {compare_last_checkpoints(straight, resumed, epochs)}"
        )
    except Exception as e:  # a run that failed leaves no checkpoint: say so, the logs say why
        print(f"mid-epoch SIGTERM + resume: nothing to compare: {type(e).__name__}: {e}")
    test = [r["top1"] for r in rows(fsdp) if r["split"] == "test"]
    best = max(val_top1(fsdp), default="missing")
    print(
        f"fsdp over gloo, 2 ranks: best val top-1 {best}; its best.dcp read by 1 rank (test_net.py): {test[-1] if test else 'missing'}"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
