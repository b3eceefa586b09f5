"""What a newcomer tripped over (issue 12): YAML errors with their position, "did you mean",
a finished run that says so, a best.pth.tar that holds only what evaluation needs."""

from __future__ import annotations

import pytest
from helpers import FAST, TRAIN, assert_ok, python, read_metrics, run

from distribuuuu import checkpoint as ckpt


@pytest.mark.slow
def test_a_finished_run_says_so_and_best_holds_only_what_evaluation_needs(tmp_path):
    args = ["OUT_DIR", str(tmp_path), *FAST, "OPTIM.MAX_EPOCH", "1"]
    assert_ok(run(python(TRAIN, *args), timeout=300))
    again = run(python(TRAIN, *args), timeout=300)
    assert_ok(again)
    lines = [line for line in again.stdout.splitlines() if "already holds a finished run" in line]
    assert len(lines) == 1 and "another OUT_DIR" in lines[0] and "OPTIM.MAX_EPOCH" in lines[0], again.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path) if r["split"] == "train"] == [1]  # nothing trained
    best = ckpt.load_checkpoint(str(tmp_path / ckpt.BEST_NAME))
    last = ckpt.load_checkpoint(str(tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)))
    assert set(best) == {"model", "ema", "epoch", "best_acc1", "best_weights", "classes", "arch", "cfg", "checksum"}
    assert all(best["model"][k].equal(v) for k, v in last["model"].items())
    assert (tmp_path / ckpt.BEST_NAME).stat().st_size < 0.6 * (
        tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)
    ).stat().st_size
