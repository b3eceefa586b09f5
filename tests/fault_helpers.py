"""The fault tests' runs and their comparison (tests/integration/test_kills_and_restarts.py,
test_exact_resume.py, test_non_finite_losses.py; tests/unit/checkpointing/test_corrupt_checkpoints.py,
test_disk_full.py; the packed-data resume of tests/integration/test_packed_data.py).

The training jobs run ``tests/scripts/tiny_train.py``: ``tools/train_net.py``'s entry point with
tests/models.py's tiny CNN (so an epoch costs about a second) and fault injection at exact steps. Every
resumed run is compared with an uninterrupted run of the same configuration: the weights must be
bit-identical, which holds only if model, optimizer, EMA, LR position, RNG states and the sampler
position all came back exactly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from helpers import REPO, clean_env, read_metrics

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint

DIGITS = str(REPO / "data" / "digits")
# Mixup draws from the global RNG and EMA has its own state: an exact resume must restore both.
# Three checkpoints kept (the default keeps one): the resumes below fall back to an older one.
TINY = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "2",
    "DATA.MIXUP_ALPHA", "0.2", "OPTIM.EMA_DECAY", "0.9", "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS,
    "TRAIN.KEEP_CKPTS", "3",
]  # fmt: skip
ONE = [*TINY, "TRAIN.PRINT_FREQ", "5", "TRAIN.CKPT_PERIOD_ITERS", "10"]
# 2 ranks: one epoch of 22 steps (the single-process runs cover resuming into a later epoch).
TWO = [*TINY, "TRAIN.PRINT_FREQ", "3", "TRAIN.CKPT_PERIOD_ITERS", "4", "TRAIN.WORKERS", "1", "OPTIM.MAX_EPOCH", "1"]
STEPS_ONE = 1436 // 32  # optimizer steps per epoch: train images // (TRAIN.BATCH_SIZE x ranks)
# pytorch/pytorch#135712: torchrun's default (static) rendezvous keeps its store across restarts,
# and a restarted round may read its peers' stale gloo addresses ("connectFullMesh failed ...
# Connection refused", or a hang). The c10d rendezvous with this variable gives each round its own.
ENV = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
RESUMED = re.compile(r"resumed from (\S+) at epoch (\d+), step (\d+)")


def _mid_epoch_checkpoints(out: Path) -> list[str]:
    """Finished mid-epoch checkpoints (files or sharded directories; not a temporary being written)."""
    names = os.listdir(out / "checkpoints") if (out / "checkpoints").is_dir() else []
    return [n for n in names if "_it_" in n and n.endswith((".pth.tar", ".dcp"))]


def _final_state(out: Path, epochs: int = 2) -> dict:
    return load_checkpoint(str(out / "checkpoints" / ckpt.checkpoint_name(epochs)))


def _assert_same_weights(a: dict, b: dict, rel: float = 0.0) -> None:
    """Model, EMA and optimizer tensors bit-identical (torch.equal, not allclose), or within ``rel``
    of each tensor's largest absolute value."""
    for name, x, y in (
        ("model", a["model"], b["model"]),
        ("ema", a["ema"]["module"], b["ema"]["module"]),
        ("momentum", a["optimizer"]["state"], b["optimizer"]["state"]),
    ):
        assert x.keys() == y.keys(), name
        for key in x:
            xs, ys = (x[key], y[key]) if name != "momentum" else (x[key]["momentum_buffer"], y[key]["momentum_buffer"])
            atol = rel * ys.float().abs().max().item() if ys.numel() else 0.0
            same = torch.equal(xs, ys) if not rel else torch.allclose(xs.float(), ys.float(), rtol=0, atol=atol)
            assert same, f"{name} {key} differs from the uninterrupted run"


def _train_epochs(out: Path) -> list[int]:
    return [r["epoch"] for r in read_metrics(out) if r["split"] == "train"]


INTERRUPTED = re.compile(
    r"^distribuuuu: interrupted \(Ctrl-C\) at epoch (\d+), step (\d+), its checkpoint written; exiting with 130 "
    r"\(run the same command again to resume there\)$",
    re.M,
)


def _tiny_state(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value)}, "epoch": int(value)}
