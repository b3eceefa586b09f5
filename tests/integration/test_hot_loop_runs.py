"""The two-process DDP loop (one 2-rank launch of tests/scripts/hot_loop_job.py, fp32 and fp16) syncs only
every PRINT_FREQ steps, its one all-reduce carrying both ranks' times. The launch of
tests/unit/training/test_hot_loop.py; the recording and the checks are tests/hot_loop_helpers.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_ok, clean_env, run_torchrun
from hot_loop_helpers import HOT_LOOP_JOB, STEPS, check_collectives, check_gathered, check_host_syncs

PRECISIONS = ("fp32", "fp16")


@pytest.fixture(scope="module")
def two_process_records(tmp_path_factory) -> Path:
    """One 2-rank launch records an epoch in each precision: ``{precision}_rank{r}.json``."""
    out = tmp_path_factory.mktemp("two_process_loop")
    assert_ok(run_torchrun(2, HOT_LOOP_JOB, str(out), *PRECISIONS, timeout=300, env=clean_env()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_process_ddp_loop_syncs_only_every_print_freq_steps(two_process_records, precision):
    for rank in range(2):
        record = json.loads((two_process_records / f"{precision}_rank{rank}.json").read_text())
        assert record["ddp"], "with two processes the trainer must train through DDP"
        assert record["steps_per_epoch"] == STEPS
        calls = [tuple(c) for c in record["calls"]]
        check_collectives(calls)
        check_host_syncs(calls)
        check_gathered(record["gathered"], 2)
    ranks = [json.loads((two_process_records / f"{precision}_rank{r}.json").read_text())["gathered"] for r in range(2)]
    for on_0, on_1 in zip(*ranks):  # one all-reduce: both ranks hold the same lists
        assert (on_0["rank_step_s"], on_0["rank_data_s"]) == (on_1["rank_step_s"], on_1["rank_data_s"])
