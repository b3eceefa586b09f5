"""The design card's config under torchrun, 2 processes: it trains on the digits when the data keys point
there. The launch of tests/unit/config/test_resnet18_config.py."""

from __future__ import annotations

import math

import pytest
from helpers import REPO, RESNET18, TRAIN, assert_ok, read_metrics, run_torchrun

from distribuuuu.config import load_cfg


@pytest.mark.slow
def test_the_resnet18_config_under_torchrun_trains_on_the_digits_when_the_data_keys_point_there(tmp_path):
    digits = str(REPO / "data" / "digits")
    data = ["TRAIN.DATASET", digits, "TEST.DATASET", digits, "MODEL.NUM_CLASSES", "10"]
    small = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.STOP_AFTER_EPOCHS", "1"]  # 1 of its 100 epochs
    result = run_torchrun(2, TRAIN, "--cfg", RESNET18, *data, *small, "OUT_DIR", str(tmp_path), timeout=400)
    assert_ok(result)
    [train] = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    [val] = [r for r in read_metrics(tmp_path) if r["split"] == "val"]
    steps = 1436 // (32 * 2)  # whole global batches of the recipe's TRAIN.BATCH_SIZE x 2 processes
    assert train["epoch"] == 1 and train["samples"] == steps * 32 * 2 and val["samples"] == 361
    # The LR of the epoch's last step: the recipe's cosine from 0.2 over 100 epochs, times its warmup
    # factor rising linearly from 0.1 to 1 over 5 epochs, both at that step's fraction of an epoch.
    at = (steps - 1) / steps
    assert train["lr"] == pytest.approx(0.2 * 0.5 * (1 + math.cos(math.pi * at / 100)) * (0.1 + 0.9 * at / 5))
    assert load_cfg(str(tmp_path / "config.yaml")).OPTIM.MAX_EPOCH == 100
