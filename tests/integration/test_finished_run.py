"""A finished run is read, not written: running again into its OUT_DIR trains nothing, says so
once, and leaves every file as it was; its best.pth.tar holds only what evaluation needs."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import EMA_EPOCHS, EMA_RUN_OPTS

from distribuuuu import cli, trainer
from distribuuuu.checkpointing import checkpoint as ckpt


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, recursively, by relative path: its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(ema_run) -> Path:
    """The shared run (tests/runs.py): 3 epochs of the tiny CNN, finished."""
    return ema_run


@pytest.mark.usefixtures("plain_logging")
@pytest.mark.parametrize(
    "changes",
    [[], ["OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "16"]],
    ids=["same-config", "fewer-epochs-and-another-batch"],
)
def test_running_again_into_a_finished_run_changes_no_byte_of_its_out_dir(finished_run, changes, capsys):
    before = _files(finished_run)
    assert {"config.yaml", "summary.md", "log.txt", "metrics.jsonl"} <= set(before)
    assert any(name.startswith("starts/") for name in before) and any(name.startswith("tb/") for name in before)
    assert cli.run_tool(trainer.train_model, ["OUT_DIR", str(finished_run), *EMA_RUN_OPTS, *changes]) == 0
    after = _files(finished_run)
    assert sorted(after) == sorted(before), "no file may be added or removed"
    assert [name for name in before if after[name] != before[name]] == [], "no file may be rewritten"
    out = capsys.readouterr()
    said = [line for line in out.out.splitlines() if "already holds a finished run" in line]
    assert len(said) == 1 and f"{EMA_EPOCHS} epochs trained" in said[0], out.out
    assert "another OUT_DIR" in said[0] and "OPTIM.MAX_EPOCH" in said[0], said[0]
    assert "global batch changed" not in out.out + out.err, "nothing is resumed, so nothing is re-seeded"


def test_a_finished_runs_best_holds_only_what_evaluation_needs(finished_run):
    best = ckpt.load_checkpoint(str(finished_run / ckpt.BEST_NAME))
    last = ckpt.load_checkpoint(str(finished_run / ckpt.CKPT_DIR / ckpt.checkpoint_name(EMA_EPOCHS)))
    assert set(best) == {
        "model", "ema", "epoch", "best_acc1", "best_weights", "best_metric", "best_value", "classes", "arch", "cfg",
        "preprocessing", "checksum",
    }  # fmt: skip
    assert (best["best_metric"], best["best_value"]) == ("top1", best["best_acc1"])  # TRAIN.BEST_METRIC's default
    best_epoch_file = finished_run / ckpt.CKPT_DIR / ckpt.checkpoint_name(best["epoch"])
    assert all(best["model"][k].equal(v) for k, v in ckpt.load_checkpoint(str(best_epoch_file))["model"].items())
    assert last["epoch"] == EMA_EPOCHS and "optimizer" in last and "optimizer" not in best
    assert (finished_run / ckpt.BEST_NAME).stat().st_size < 0.6 * best_epoch_file.stat().st_size


def test_a_run_with_log_plot_false_draws_no_plot_and_its_summary_says_how_to(finished_run):
    # tiny_train.py runs with LOG.PLOT False unless told otherwise (tests/integration/test_export_and_tracking.py: a plot drawn).
    text = (finished_run / "summary.md").read_text()
    assert f"- plot: none (LOG.PLOT False; python tools/plot_metrics.py {finished_run} draws it)" in text
    assert not (finished_run / "metrics.png").exists()
