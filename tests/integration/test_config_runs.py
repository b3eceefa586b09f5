"""A bad input under torchrun, 2 processes: printed once and named by torchrun's failure summary. The launch of
tests/unit/config/test_config.py."""

from __future__ import annotations

import pytest
from helpers import ERROR_PREFIX, TRAIN, run_torchrun


@pytest.mark.slow
def test_bad_input_under_torchrun_is_printed_once_and_named_by_torchruns_failure_summary(tmp_path):
    # A launch: what torchrun (the launcher) reports of its ranks' failure is the property.
    missing = "/nonexistent/imagenet"
    result = run_torchrun(2, TRAIN, "OUT_DIR", str(tmp_path), "TRAIN.DATASET", missing, timeout=300)
    assert result.returncode != 0
    combined = result.stdout + result.stderr
    printed = [line for line in combined.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(printed) <= 1, combined[-4000:]  # rank 0 prints it, unless torchrun stopped it first
    # torchrun's summary shows the first rank to fail: whichever it is, its error file holds our line.
    root_cause = combined.split("Root Cause (first observed failure):")[-1]
    [named] = [line for line in root_cause.splitlines() if line.strip().startswith("traceback :")]
    assert named.split("traceback :")[1].strip() == f"{ERROR_PREFIX} TRAIN.DATASET: dataset folder not found: " + (
        f"{missing}/train (split 'train')"
    ), combined[-4000:]
    assert not list(tmp_path.rglob("*.pth.tar"))
