"""tools/avg_checkpoints.py: the last or best N checkpoints of an OUT_DIR averaged into one that the
tools take like any other. The checkpoints are the shared EMA run's (tests/runs.py): 3 epochs of the
tiny CNN at a high LR, whose weights differ from epoch to epoch."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import EVAL_TINY, REPO, TEST, TINY_TRAIN, assert_ok, in_process, read_metrics

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.average import averaged_checkpoint

AVG = str(REPO / "tools" / "avg_checkpoints.py")
CONVERT = str(REPO / "tools" / "convert_checkpoint.py")
PREDICT, EXPORT = str(REPO / "tools" / "predict.py"), str(REPO / "tools" / "export.py")
DIGITS = str(REPO / "data" / "digits")
DATA = ["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]


def _ckpt(out: Path, epoch: int) -> str:
    return str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(epoch))


def _weights(path: str, kind: str = "model") -> dict:
    return ckpt.model_state_from(ckpt.load_checkpoint(path), kind)


def test_a_checkpoint_averaged_with_itself_is_itself(ema_run):
    path = _ckpt(ema_run, 2)
    averaged, original = averaged_checkpoint([path, path])["model"], _weights(path)
    assert averaged.keys() == original.keys()
    assert all(torch.equal(averaged[k], original[k]) and averaged[k].dtype == original[k].dtype for k in original)


@pytest.mark.parametrize("kind", ["model", "ema"])
def test_two_checkpoints_average_to_the_element_wise_mean(ema_run, kind):
    a, b = _weights(_ckpt(ema_run, 1), kind), _weights(_ckpt(ema_run, 2), kind)
    averaged = averaged_checkpoint([_ckpt(ema_run, 1), _ckpt(ema_run, 2)], kind)["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())  # the test means something
    for k in a:
        if a[k].is_floating_point():  # the float64 mean rounded once: the exact mean, correctly rounded
            assert torch.equal(averaged[k], ((a[k].double() + b[k].double()) / 2).to(a[k].dtype)), k
        else:  # num_batches_tracked: the newest input's
            assert torch.equal(averaged[k], b[k]), k


def test_last_n_takes_dcp_folders_like_files_and_every_tool_takes_the_average(ema_run, tmp_path):
    # A copy of the run whose epoch 2 is a .dcp folder: the same average as from the files.
    mixed = tmp_path / "mixed"
    shutil.copytree(ema_run, mixed)
    assert_ok(in_process(CONVERT, _ckpt(mixed, 2), str(mixed / ckpt.CKPT_DIR / ckpt.checkpoint_name(2, sharded=True))))
    Path(_ckpt(mixed, 2)).unlink()
    out_files, out_mixed = str(tmp_path / "files.pth.tar"), str(tmp_path / "mixed.pth.tar")
    assert_ok(in_process(AVG, str(ema_run), "--last", "2", "-o", out_files))
    result = in_process(AVG, str(mixed), "--last", "2", "-o", out_mixed)
    assert_ok(result)
    assert "ckpt_ep_002.dcp, ckpt_ep_003.pth.tar" in result.stdout
    files, from_mixed = _weights(out_files), _weights(out_mixed)
    assert all(torch.equal(files[k], from_mixed[k]) for k in files)
    saved = ckpt.load_checkpoint(out_files)
    newest = ckpt.load_checkpoint(_ckpt(ema_run, 3))
    assert (saved["classes"], saved["cfg"], saved["arch"]) == (newest["classes"], newest["cfg"], newest["arch"])
    assert saved["averaged"]["checkpoints"] == ["ckpt_ep_002.pth.tar", "ckpt_ep_003.pth.tar"]
    # test_net.py evaluates it like any checkpoint (its config from the checkpoint).
    assert_ok(in_process(TEST, "MODEL.WEIGHTS", out_files, "OUT_DIR", str(tmp_path / "eval")))
    [test] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    assert test["samples"] > 0 and 0 <= test["top1"] <= 100
    # predict.py and export.py (ONNX, checked against PyTorch) and fine-tuning take it too.
    assert_ok(in_process(PREDICT, "--weights", out_files, "--json", str(REPO / "data/digits/val/7/0017.png")))
    if importlib.util.find_spec("onnxscript") and importlib.util.find_spec("onnxruntime"):
        assert_ok(in_process(EXPORT, "--weights", out_files, "--out", str(tmp_path / "m")))
    tuned = tmp_path / "tuned"
    opts = [*EVAL_TINY, "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "64", "MODEL.WEIGHTS", out_files]
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(tuned), *DATA, *opts))


def test_best_n_ranks_by_the_named_metric_and_precise_bn_recomputes_the_statistics(ema_run, tmp_path):
    vals = {r["epoch"]: r for r in read_metrics(ema_run) if r["split"] == "val" and r["weights"] == "ema"}
    best_loss = min(vals, key=lambda e: (vals[e]["loss"], -e))
    out = str(tmp_path / "best.pth.tar")
    result = in_process(AVG, str(ema_run), "--best", "1", "--metric", "loss", "--weights", "ema", "-o", out)
    assert_ok(result)
    assert f"ckpt_ep_{best_loss:03d}.pth.tar" in result.stdout.splitlines()[0]
    assert all(
        torch.equal(a, b) for a, b in zip(_weights(out).values(), _weights(_ckpt(ema_run, best_loss), "ema").values())
    )
    # --precise-bn: the statistics are precise BN's for the averaged weights, not the average's.
    precise = str(tmp_path / "precise.pth.tar")
    args = [str(ema_run), "--last", "2", "--precise-bn", "100", "-o", precise]
    assert_ok(in_process(AVG, *args, "TRAIN.WORKERS", "0"))
    plain = averaged_checkpoint([_ckpt(ema_run, 2), _ckpt(ema_run, 3)])["model"]
    recomputed = _weights(precise)
    for k in plain:
        same = torch.equal(plain[k], recomputed[k])
        assert same != k.endswith(("running_mean", "running_var")), k  # only the statistics changed
    assert_ok(in_process(TEST, "MODEL.WEIGHTS", precise, "OUT_DIR", str(tmp_path / "eval")))


@pytest.mark.parametrize(
    "args, names",
    [
        (["--last", "2"], "no checkpoints in"),
        (["--last", "5"], "--last 5:"),
        (["--best", "1", "--metric", "top9"], "--metric top9: no val record"),
        (["--best", "9"], "--best 9: only 3 epoch-end checkpoint(s)"),
        (
            ["--best", "1", "--weights", "ema"],
            "val record of the ema weights (a run without EMA weights, OPTIM.EMA_DECAY 0, or none evaluated yet)",
        ),
    ],
)
def test_bad_input_is_one_line_naming_it_and_exit_2(ema_run, tmp_path, args, names):
    out_dir = tmp_path / "empty" if names == "no checkpoints in" else ema_run
    if "--weights" in args:  # a run without EMA: its val records are the raw weights'
        out_dir = tmp_path / "no_ema"
        out_dir.mkdir()
        raw = [r for r in read_metrics(ema_run) if r.get("weights", "model") == "model"]
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    out_dir.mkdir(exist_ok=True)
    result = in_process(AVG, str(out_dir), *args, "-o", str(tmp_path / "avg.pth.tar"))
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("avg_checkpoints.py: error: ") and names in line, line
    assert not (tmp_path / "avg.pth.tar").exists()


def test_a_checkpoint_name_or_an_existing_output_is_refused(ema_run, tmp_path):
    for output in (_ckpt(ema_run, 1), str(tmp_path / "ckpt_ep_009.pth.tar")):
        result = in_process(AVG, str(ema_run), "--last", "1", "-o", output)
        assert result.returncode == 2 and output in result.stderr, result.stderr
