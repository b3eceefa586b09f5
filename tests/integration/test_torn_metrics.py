"""metrics.jsonl survives a torn tail: a run that died mid-append leaves half a line; the next run
into that OUT_DIR cuts it off before appending (one warning naming the line), and every reader
skips a line that is not JSON with one warning instead of refusing the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    DUMMY_OPTS,
    REPO,
    TINY_ARCH,
    TRAIN,
    assert_ok,
    in_process,
    read_metrics,
)

from distribuuuu.records.metrics_file import repair_torn_tail

SUMMARIZE, PLOT = str(REPO / "tools" / "summarize.py"), str(REPO / "tools" / "plot_metrics.py")
TORN = '{"split": "train", "epoch": 2, "lo'  # what a user found after a run died mid-append
OPTS = [*DUMMY_OPTS, "MODEL.ARCH", TINY_ARCH, "TRAIN.WORKERS", "0"]


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> Path:
    """A finished 1-epoch run of the tiny CNN (tools/train_net.py in this process)."""
    out = tmp_path_factory.mktemp("one_epoch")
    assert_ok(in_process(TRAIN, *OPTS, "OUT_DIR", str(out)))
    return out


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def test_a_resumed_run_cuts_a_torn_last_line_and_appends_whole_records(one_epoch, tmp_path):
    out = _copy(one_epoch, tmp_path / "run")
    metrics = out / "metrics.jsonl"
    good = metrics.read_bytes()
    torn_line = good.count(b"\n") + 1
    metrics.write_bytes(good + TORN.encode())

    result = in_process(TRAIN, *OPTS, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "2")
    assert_ok(result)

    warned = [line for line in result.stdout.splitlines() if "torn last line" in line]
    assert len(warned) == 1 and f"{metrics}:{torn_line}:" in warned[0], result.stdout
    assert metrics.read_bytes().startswith(good), "every whole record before the torn line is kept as it was"
    records = read_metrics(out)  # json.loads of every line: no half line left, none glued
    assert [(r["split"], r["epoch"]) for r in records if r["split"] == "train"] == [("train", 1), ("train", 2)]
    assert "epochs trained: 2" in (out / "summary.md").read_text(), "the end-of-training summary reads the file too"


def test_a_complete_last_record_without_its_newline_is_kept_and_ended(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"epoch": 1, "split": "train"}\n{"epoch": 1, "split": "val"}')
    repair_torn_tail(str(metrics))
    assert metrics.read_text() == '{"epoch": 1, "split": "train"}\n{"epoch": 1, "split": "val"}\n'


@pytest.mark.parametrize("tool", ["summarize", "plot_metrics"])
def test_the_readers_skip_a_torn_line_with_one_warning(one_epoch, tmp_path, tool, caplog):
    out = _copy(one_epoch, tmp_path / "run")
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    # A torn line mid-file (a resume glued a train record onto it, as before the repair) and one at the end.
    metrics.write_text(lines[0] + TORN + lines[0] + "".join(lines[1:]) + TORN)
    val = [json.loads(line) for line in lines if json.loads(line)["split"] == "val"][-1]

    if tool == "summarize":
        result = in_process(SUMMARIZE, str(out), "--no-write")
        assert_ok(result)
        assert f"best val top-1: {val['top1']:.2f}%" in result.stdout, result.stdout
        assert f"- plot: none (--no-write; python tools/plot_metrics.py {out} draws it)" in result.stdout
    else:
        result = in_process(PLOT, str(out), "--output", str(tmp_path / "plot.png"))
        assert_ok(result)
        assert (tmp_path / "plot.png").stat().st_size > 0
    # The tools run in this process, where the warning reaches pytest's handlers, not Python's
    # last-resort stderr one: read it there.
    warned = [r.getMessage() for r in caplog.records if "skipped line" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"{metrics}: skipped line(s) 2, {len(lines) + 2}:" in warned[0], warned[0]
