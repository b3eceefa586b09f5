"""Device-specific paths: SyncBatchNorm and pinned memory decided by the device; fp16 and NCCL on CUDA.

The CPU tests always run. The CUDA tests skip cleanly on machines without a GPU (as CI's).
"""

from __future__ import annotations

import pytest
import torch
from helpers import FAST, TRAIN, assert_ok, clean_env, python, read_metrics, run, torchrun
from torch import nn

from distribuuuu import trainer
from distribuuuu.checkpoint import load_checkpoint
from distribuuuu.config import load_cfg
from distribuuuu.data import build_train_split
from distribuuuu.distributed import DistEnv

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def test_syncbn_on_cpu_with_several_ranks_keeps_batchnorm_and_warns(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(trainer.logger, "warning", lambda msg, *a: warnings.append(msg % a if a else msg))
    cfg = load_cfg(opts=["MODEL.SYNCBN", "True"])
    model = trainer.build_model_for(cfg, DistEnv(rank=0, world_size=2, launcher="torchrun"))
    assert _count(model, nn.SyncBatchNorm) == 0 and _count(model, nn.BatchNorm2d) > 0
    assert len(warnings) == 1 and "MODEL.SYNCBN ignored" in warnings[0]


def test_cpu_loader_does_not_pin_memory():
    cfg = load_cfg(opts=["TRAIN.PIN_MEMORY", "True"])
    assert build_train_split(cfg, DistEnv()).loader.pin_memory is False


@needs_cuda
def test_syncbn_on_cuda_converts_every_batchnorm():
    cfg = load_cfg(opts=["MODEL.SYNCBN", "True"])
    env = DistEnv(rank=0, world_size=1, device=torch.device("cuda", 0))
    model = trainer.build_model_for(cfg, env)
    assert _count(model, nn.SyncBatchNorm) > 0 and _count(model, nn.BatchNorm2d) == 0
    assert next(model.parameters()).device.type == "cuda"


@needs_cuda
def test_cuda_loader_pins_memory():
    cfg = load_cfg(opts=["TRAIN.PIN_MEMORY", "True"])
    assert build_train_split(cfg, DistEnv(device=torch.device("cuda", 0))).loader.pin_memory is True


@needs_cuda
def test_fp16_with_grad_scaler_trains_on_cuda_and_checkpoints_the_scaler(tmp_path):
    result = run(python(TRAIN, "OUT_DIR", str(tmp_path), *FAST, "TRAIN.PRECISION", "fp16"), timeout=600)
    assert_ok(result)
    train = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert len(train) == 2 and train[-1]["loss"] < train[0]["loss"]
    state = load_checkpoint(str(tmp_path / "checkpoints" / "ckpt_ep_002.pth.tar"))
    assert state["scaler"] is not None and state["scaler"]["scale"] > 0
    assert all(v.dtype == torch.float32 for v in state["model"].values() if v.is_floating_point())


@needs_two_gpus
def test_two_process_nccl_job_with_syncbn_trains(tmp_path):
    cmd = torchrun(2, TRAIN, "OUT_DIR", str(tmp_path), *FAST, "MODEL.SYNCBN", "True")
    result = run(cmd, timeout=600, env=clean_env())
    assert_ok(result)
    assert "cuda:1" in (tmp_path / "log.txt").read_text(), "rank 1 runs on its own GPU (rank table)"
    assert "MODEL.SYNCBN ignored" not in result.stdout + result.stderr
    assert [r["epoch"] for r in read_metrics(tmp_path) if r["split"] == "val"] == [1, 2]
