"""End to end: the default config trains resnet18 on the embedded digits to >= 95% val top-1.

The torchrun run reads a packed copy of the digits that tools/pack_dataset.py makes here (WebDataset
shards); tests/test_packed_data.py shows that copy trains to the very same metrics and weights as
the ImageFolder, and reads over HTTP exactly as from disk. The plain run reads the ImageFolder.
"""

from __future__ import annotations

import pytest
from helpers import REPO, TRAIN, assert_ok, clean_env, python, read_metrics, run, torchrun

pytestmark = pytest.mark.slow  # two 10-epoch resnet18 runs
# 10 epochs reach 96-98% on the CPUs seen so far (README): far above this floor on any of them.
TARGET_TOP1 = 95.0


def _final_val_top1(out_dir) -> float:
    val = [r for r in read_metrics(out_dir) if r["split"] == "val" and r["weights"] == "model"]
    assert [r["epoch"] for r in val] == list(range(1, 11)), "one val line per epoch of the default 10"
    assert val[-1]["samples"] == 361, "every val image evaluated exactly once"
    return val[-1]["top1"]


def test_default_config_under_torchrun_two_processes_reaches_95_percent_from_packed_shards(tmp_path):
    pytest.importorskip("wids")
    packed = tmp_path / "packed"
    assert_ok(run(python(str(REPO / "tools" / "pack_dataset.py"), str(REPO / "data" / "digits"), str(packed))))
    data = ["TRAIN.DATASET", str(packed), "TEST.DATASET", str(packed), "DATA.SHARD_CACHE", str(tmp_path / "cache")]
    result = run(torchrun(2, TRAIN, "OUT_DIR", str(tmp_path / "out"), *data), timeout=600)
    assert_ok(result)
    assert "torchrun launch, 2 process(es)" in result.stdout
    assert _final_val_top1(tmp_path / "out") >= TARGET_TOP1


def test_default_config_in_one_plain_process_reaches_95_percent(tmp_path):
    env = clean_env()
    del env["OMP_NUM_THREADS"]  # a lone process may use both cores
    result = run(python(TRAIN, "OUT_DIR", str(tmp_path)), timeout=600, env=env)
    assert_ok(result)
    assert "none launch, 1 process(es)" in result.stdout
    assert _final_val_top1(tmp_path) >= TARGET_TOP1
