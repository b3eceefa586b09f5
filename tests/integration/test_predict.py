"""tools/predict.py: classify image files and folders with a checkpoint trained on the embedded digits."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_ok, in_process, read_metrics
from runs import EMA_EPOCHS

pytestmark = pytest.mark.slow  # every test reads the checkpoint of the shared 3-epoch run (tests/runs.py)

PREDICT = str(REPO / "tools" / "predict.py")
VAL = REPO / "data" / "digits" / "val"


@pytest.fixture(scope="module")
def trained(ema_run) -> tuple[Path, dict[str, float]]:
    """The shared EMA run's last checkpoint and its val top-1 per weights kind. Its input keys are
    not the defaults: predict.py must take them from the checkpoint, or its accuracy collapses."""
    val = {r["weights"]: r["top1"] for r in read_metrics(ema_run) if r["split"] == "val" and r["epoch"] == EMA_EPOCHS}
    # Far above the 10% of chance, so that preprocessing not taken from the checkpoint would show;
    # not a higher floor: the accuracy after 3 epochs at a high LR depends on CPU and seed (57-75%, 4 seeds).
    assert min(val.values()) >= 40.0, f"the checkpoint should be good enough to make the comparison meaningful: {val}"
    return ema_run / "checkpoints" / f"ckpt_ep_{EMA_EPOCHS:03d}.pth.tar", val


def predict(weights: Path, *args: str):
    """tools/predict.py's __main__ in this process: its stdout, stderr and exit code."""
    return in_process(PREDICT, "--weights", str(weights), *args)


def _true_class(path: str) -> str:
    return Path(path).parent.name  # ImageFolder layout: val/<class>/<image>


@pytest.mark.parametrize("kind", ["model", "ema"])
def test_predict_on_val_folder_matches_the_checkpoints_val_accuracy(trained, kind):
    weights, val_top1 = trained
    result = predict(weights, str(VAL), "--json", "--topk", "1", *(["--ema"] if kind == "ema" else []))
    assert_ok(result)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    expected_paths = sorted(str(p) for p in VAL.rglob("*.png"))
    assert sorted(r["path"] for r in records) == expected_paths, "every val image exactly once"
    correct = sum(r["topk"][0]["class"] == _true_class(r["path"]) for r in records)
    accuracy = 100.0 * correct / len(records)
    assert accuracy == pytest.approx(val_top1[kind], abs=1.0), (accuracy, val_top1)


def test_predict_prints_topk_names_with_descending_probabilities(trained, tmp_path):
    weights, _ = trained
    # A nested folder with two images and a non-image file, plus one image named directly.
    (tmp_path / "a" / "b").mkdir(parents=True)
    shutil.copy(sorted((VAL / "3").iterdir())[0], tmp_path / "a" / "three.png")
    shutil.copy(sorted((VAL / "8").iterdir())[0], tmp_path / "a" / "b" / "eight.PNG")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    single = sorted((VAL / "5").iterdir())[0]
    result = predict(weights, str(tmp_path / "a"), str(single), "--topk", "3")
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        str(tmp_path / "a" / "three.png"),
        str(tmp_path / "a" / "b" / "eight.PNG"),
        str(single),
    ]
    classes = torch.load(weights, weights_only=True)["classes"]
    for line in lines:
        top = re.findall(r"(\S+) \((\d\.\d{3})\)", line.split(": ", 1)[1])
        probs = [float(p) for _, p in top]
        assert len(top) == 3 and all(name in classes for name, _ in top), line
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 2e-3, line


@pytest.fixture
def checkpoint_without_classes(trained, tmp_path) -> Path:
    state = torch.load(trained[0], weights_only=True)
    del state["classes"]
    path = tmp_path / "no_classes.pth.tar"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("case", ["missing-checkpoint", "no-images", "no-class-names"])
def test_predict_bad_input_exits_2_with_one_error_line(trained, checkpoint_without_classes, tmp_path, case):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "readme.txt").write_text("no images here")
    weights, path, message = {
        "missing-checkpoint": (tmp_path / "nope.pth.tar", str(VAL / "0"), "checkpoint not found"),
        "no-images": (trained[0], str(empty), "no images"),
        "no-class-names": (checkpoint_without_classes, str(VAL / "0"), "holds no class names"),
    }[case]
    result = predict(weights, path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("predict.py: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
