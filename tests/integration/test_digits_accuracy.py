"""End to end: config/digits_recipe.yaml trains resnet18 on the embedded digits to >= 98% val top-1,
raw and EMA weights, and test_net.py reproduces the run's numbers from its checkpoints.

One run, the session's ``digits_run`` (tests/runs.py): the recipe as its header says to run it (ddp
under torchrun with 2 processes), reading a packed copy of the digits made by
tools/pack_dataset.py (WebDataset shards) from a real HTTP server on 127.0.0.1.
tests/integration/test_packed_data.py shows that a packed copy trains to the very same weights as the
ImageFolder and reads over HTTP exactly as from disk; tests/integration/test_fsdp_runs.py and
tests/integration/test_resume_world_size.py that fsdp trains ddp's weights; tests/integration/test_tool_matrix.py that
every tool reads sharded checkpoints as single files. The default config (SGD, 10 epochs: the
README's first command) trains through the same trainer; its figures are measured in the README,
not again here, where a second 10-epoch run would nearly double the suite's largest cost.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO, TEST, assert_ok, in_process, read_metrics

from distribuuuu.checkpointing import checkpoint
from distribuuuu.config import load_cfg

pytestmark = pytest.mark.slow  # a 12-epoch resnet18 run (the session's digits_run)
RECIPE = str(REPO / "config" / "digits_recipe.yaml")
# Measured: 99.45% from the ImageFolder (docs/recipe.md, Intel Xeon), 98.89% raw and EMA from packed
# shards (AMD EPYC, ddp and fsdp alike), 99.45% in bf16 on an H100 (docs/gpu.md).
TARGET_TOP1 = 98.0


def _final_val_top1(out_dir: Path, weights: str) -> float:
    return [r for r in read_metrics(out_dir) if r["split"] == "val" and r["weights"] == weights][-1]["top1"]


def _test_net(data: list[str], out_dir: Path, *opts: str) -> dict:
    result = in_process(TEST, "--cfg", RECIPE, "OUT_DIR", str(out_dir), *data, *opts)  # test_net.py's __main__ here
    assert_ok(result)
    [record] = [r for r in read_metrics(out_dir) if r["split"] == "test"]
    return record


def test_the_digits_recipe_on_packed_shards_over_http_reaches_98_percent_and_test_net_reproduces_it(
    digits_run, tmp_path
):
    out, result, data = digits_run
    assert_ok(result)
    assert "torchrun launch, 2 process(es)" in result.stdout
    cache = Path(data[data.index("DATA.SHARD_CACHE") + 1])
    fetched = list(cache.iterdir())
    assert fetched and not any(p.is_symlink() for p in fetched), "the shards came over HTTP into the cache"
    epochs = load_cfg(RECIPE).OPTIM.MAX_EPOCH
    val = [r for r in read_metrics(out) if r["split"] == "val"]
    # The raw and the EMA weights are evaluated every epoch, each on every val image exactly once.
    assert [(r["epoch"], r["weights"]) for r in val] == [(e, w) for e in range(1, epochs + 1) for w in ("model", "ema")]
    assert {r["samples"] for r in val} == {361}
    assert _final_val_top1(out, "model") >= TARGET_TOP1
    assert _final_val_top1(out, "ema") >= TARGET_TOP1
    best = checkpoint.load_checkpoint(str(out / checkpoint.BEST_NAME))
    first_best = max(val, key=lambda r: r["top1"])  # max() keeps the first of equals, as the trainer
    assert (best["best_acc1"], best["best_weights"]) == (first_best["top1"], first_best["weights"])
    # test_net.py, one process (this one), on the same packed val split: the best weights as the 2 ranks scored them.
    kind = best["best_weights"]
    tested = _test_net(
        data, tmp_path / "best", "MODEL.WEIGHTS", str(out / checkpoint.BEST_NAME), "MODEL.WEIGHTS_KIND", kind
    )
    assert (tested["samples"], tested["weights"], tested["top1"]) == (361, kind, first_best["top1"])
    # And the EMA weights of the last checkpoint, read from the ImageFolder the shards were packed from.
    last = checkpoint.list_checkpoints(str(out / checkpoint.CKPT_DIR))[-1]
    tested = _test_net([], tmp_path / "ema", "MODEL.WEIGHTS", last, "MODEL.WEIGHTS_KIND", "ema")
    assert tested["weights"] == "ema"
    assert abs(tested["top1"] - _final_val_top1(out, "ema")) <= 100 / 361 + 1e-9  # 1 image: batch-size rounding
