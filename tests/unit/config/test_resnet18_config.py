"""The design card's command: ``torchrun --nproc_per_node=8 tools/train_net.py --cfg config/resnet18.yaml``
runs as written where ImageNet is at the configured path, stops in one line naming the missing
folder where it is not, and trains on any ImageFolder the data keys point at."""

from __future__ import annotations

import math

import pytest
from helpers import REPO, TRAIN, assert_ok, read_metrics, run_torchrun

from distribuuuu import cli, trainer
from distribuuuu.config import load_cfg

RESNET18 = str(REPO / "config" / "resnet18.yaml")
ROW = REPO / "config" / "imagenet" / "resnet18_b256_8gpu.yaml"  # the recipe the file is


def test_the_resnet18_config_is_the_8_gpu_resnet18_recipe_of_the_imagenet_zoo():
    mine, row = load_cfg(RESNET18), load_cfg(str(ROW))
    assert mine.OUT_DIR != row.OUT_DIR, "its own OUT_DIR: one per run"
    mine.defrost()
    mine.OUT_DIR = row.OUT_DIR
    assert mine == row


@pytest.mark.usefixtures("plain_logging")
def test_the_resnet18_config_without_imagenet_stops_in_one_line_naming_the_missing_folder(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # ./data/ILSVRC is relative to where the command starts: absent here
    assert cli.run_tool(trainer.train_model, ["--cfg", RESNET18]) == cli.EXIT_BAD_INPUT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distribuuuu: error: TRAIN.DATASET"), lines
    assert "data/ILSVRC/train" in lines[0], lines[0]
    assert not (tmp_path / "output").exists(), "nothing written"


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
