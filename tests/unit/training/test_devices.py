"""Device-specific paths on the CPU: SyncBatchNorm and pinned memory decided by the device.

Their CUDA side (SyncBatchNorm conversion and statistics, pinned loaders, fp16 with the GradScaler,
NCCL) is checked by tools/gpu_check.py on a machine with GPUs.
"""

from __future__ import annotations

from torch import nn

from distribuuuu.config import load_cfg
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training import parallelize
from distribuuuu.training.inputs import build_train_split


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def test_syncbn_on_cpu_with_several_ranks_keeps_batchnorm_and_warns(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(parallelize.logger, "warning", lambda msg, *a: warnings.append(msg % a if a else msg))
    cfg = load_cfg(opts=["MODEL.SYNCBN", "True"])
    model = parallelize.build_model_for(cfg, DistEnv(rank=0, world_size=2, launcher="torchrun"))
    assert _count(model, nn.SyncBatchNorm) == 0 and _count(model, nn.BatchNorm2d) > 0
    assert len(warnings) == 1 and "MODEL.SYNCBN ignored" in warnings[0]


def test_cpu_loader_does_not_pin_memory():
    cfg = load_cfg(opts=["TRAIN.PIN_MEMORY", "True"])
    assert build_train_split(cfg, DistEnv()).loader.pin_memory is False
