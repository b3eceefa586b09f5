"""End to end: the default config trains resnet18 on the embedded digits to >= 95% val top-1."""

from __future__ import annotations

import pytest
from helpers import assert_ok, read_metrics

pytestmark = pytest.mark.slow  # a 10-epoch resnet18 run (the session's digits_run, shared with fine-tuning)
# 10 epochs reach 96-98% on the CPUs seen so far (README): far above this floor on any of them.
TARGET_TOP1 = 95.0


def _final_val_top1(out_dir) -> float:
    val = [r for r in read_metrics(out_dir) if r["split"] == "val" and r["weights"] == "model"]
    assert [r["epoch"] for r in val] == list(range(1, 11)), "one val line per epoch of the default 10"
    assert val[-1]["samples"] == 361, "every val image evaluated exactly once"
    return val[-1]["top1"]


# One run: a plain process trains through the same trainer (test_launch, test_experiments and
# others train that way), so a second 10-epoch run in one process would only repeat this one.
def test_default_config_under_torchrun_two_processes_reaches_95_percent(digits_run):
    out, result = digits_run
    assert_ok(result)
    assert "torchrun launch, 2 process(es)" in result.stdout
    assert _final_val_top1(out) >= TARGET_TOP1
