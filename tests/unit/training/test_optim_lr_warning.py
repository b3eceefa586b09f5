"""An adaptive optimizer left at SGD's LR is said in one warning: AdamW and Muon (whose AdamW part
takes OPTIM.BASE_LR, and whose matrices are scaled to AdamW's RMS) at 0.05 diverge or stall."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from distribuuuu.config import load_cfg
from distribuuuu.training.optim import build_optimizer


@pytest.mark.parametrize(
    ("optimizer", "lr", "warned"),
    [("adamw", "0.05", True), ("muon", "0.05", True), ("adamw", "0.001", False), ("sgd", "0.05", False)],
)
def test_an_adaptive_optimizer_at_an_sgd_lr_is_warned_of_once(caplog, optimizer, lr, warned):
    cfg = load_cfg(None, ["OPTIM.OPTIMIZER", optimizer, "OPTIM.BASE_LR", lr])
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        build_optimizer(model, cfg.OPTIM)
    said = [r.getMessage() for r in caplog.records if "OPTIM.BASE_LR" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert f"OPTIM.OPTIMIZER {optimizer}" in said[0] and "1e-3" in said[0]
