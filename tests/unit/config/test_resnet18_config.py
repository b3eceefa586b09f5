"""The design card's command: ``torchrun --nproc_per_node=8 tools/train_net.py --cfg config/resnet18.yaml``
runs as written where ImageNet is at the configured path, stops in one line naming the missing
folder where it is not, and trains on any ImageFolder the data keys point at (under torchrun:
tests/integration/test_resnet18_config_runs.py)."""

from __future__ import annotations

import pytest
from helpers import REPO, RESNET18

from distribuuuu import cli, trainer
from distribuuuu.config import load_cfg

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
