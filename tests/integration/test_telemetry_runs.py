"""A rank late with its batches, two ranks under torchrun: named as the straggler with its host. The launch of
tests/unit/records/test_telemetry.py."""

from __future__ import annotations

import re
import socket

import pytest
from helpers import EVAL_TINY, TINY_TRAIN, assert_ok, clean_env, read_metrics, run_torchrun


@pytest.mark.slow
def test_a_rank_late_with_its_batches_is_named_as_the_straggler_with_its_host(tmp_path):
    """Two ranks under torchrun; rank 1 waits 0.2 s more for each batch (tiny_train.py's slow-data hook), so
    rank 0 waits as long in every gradient all-reduce: their step times match, rank 1's data wait names it."""
    opts = [*EVAL_TINY, "TRAIN.SPLIT", "val", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "4", "TRAIN.BATCH_SIZE", "16"]
    result = run_torchrun(2, TINY_TRAIN, "OUT_DIR", str(tmp_path), *opts, env=clean_env(FAULT_SLOW_DATA="1:0.2"))
    assert_ok(result)
    output = result.stdout + result.stderr
    found = r"straggler at epoch 1, step (\d+): rank (\d) on (\S+) is ([\d.]+) median steps behind"
    warnings = re.findall(found, output)  # one a window, by rank 0 alone
    assert warnings and {(rank, host) for _, rank, host, _ in warnings} == {("1", socket.gethostname())}, output
    [train] = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert train["slowest_rank"] in (0, 1) and train["straggler_windows"] == len(warnings) == 3  # steps 4, 8, 11
    assert abs(train["rank_step_s"][0] - train["rank_step_s"][1]) < 0.2  # the all-reduce evens the steps out
