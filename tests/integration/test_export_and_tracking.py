"""Export (ONNX, torch.export), trackers (W&B offline, MLflow local), TensorBoard curves,
the run summary, and the terminal progress bar.

One short real run on the digits (two epochs, stopped after the first and resumed) serves the
tracker, TensorBoard, summary and export tests; each compares what it reads back, through the
library's own reader, with metrics.jsonl, log.txt or an independent PyTorch computation.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    DUMMY_OPTS,
    EVAL_TINY,
    FAST_ARCH,
    REPO,
    TINY_TRAIN,
    TRAIN,
    Started,
    assert_ok,
    in_process,
    lone_env,
    python,
    read_metrics,
)

from distribuuuu.config import get_cfg_defaults, load_cfg
from distribuuuu.models import register_model
from distribuuuu.records.writer import MetricsWriter
from distribuuuu.records.writer import epoch_curves as record_curves

EXPORT = str(REPO / "tools" / "export.py")
SUMMARIZE = str(REPO / "tools" / "summarize.py")
VAL = REPO / "data" / "digits" / "val"
PRINT_FREQ, STEPS_PER_EPOCH = 5, 11  # 361 val images (the train split here) / batch 32
RUN_OPTS = [
    "MODEL.ARCH", FAST_ARCH, "TRAIN.SPLIT", "val", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "2",
    "TRAIN.PRINT_FREQ", str(PRINT_FREQ), "OPTIM.WEIGHT_DECAY", "0.0001",
]  # fmt: skip
TRACKERS = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name)]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """Epoch 1 (TRAIN.STOP_AFTER_EPOCHS 1), then a resumed run for epoch 2, with the installed
    trackers: train_net.py's __main__ twice in this process (both cores)."""
    out = tmp_path_factory.mktemp("tracked")
    opts = [*RUN_OPTS, "OUT_DIR", str(out), "LOG.TRACKERS", repr(TRACKERS)]
    env = lone_env()
    assert_ok(in_process(TRAIN, *opts, "TRAIN.STOP_AFTER_EPOCHS", "1", env=env))
    assert_ok(in_process(TRAIN, *opts, env=env))
    if (
        "wandb" in TRACKERS
    ):  # the W&B service the runs started ends now: at this process's exit, it would outlive the session
        import wandb

        wandb.teardown()
    return out


def epoch_curves(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's per-epoch curves as tag -> {epoch: value}, tags as the writer names them."""
    curves: dict[str, dict[int, float]] = {}
    for r in read_metrics(out):
        for tag, value in record_curves(r).items():
            curves.setdefault(tag, {})[r["epoch"]] = value
    return curves


def logged_windows(out: Path) -> dict[int, tuple[float, float, float]]:
    """log.txt's window lines: global step -> (loss, lr, img/s) as printed."""
    pattern = re.compile(r"epoch (\d+)/\d+  step (\d+)/\d+  loss ([\d.]+) .* lr ([\d.e+-]+)  (\d+) img/s")
    windows = {}
    for m in pattern.finditer((out / "log.txt").read_text()):
        epoch, step = int(m.group(1)), int(m.group(2))
        windows[(epoch - 1) * STEPS_PER_EPOCH + step] = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
    return windows


# ------------------------------------------------------------------------------------------------
# Trackers
# ------------------------------------------------------------------------------------------------
def wandb_history(out: Path, run_id: str) -> list[dict]:
    """The history rows of every offline W&B run file of ``run_id`` (oldest first).

    wandb 0.31 ships no Python reader for offline run files (its datastore moved into the Go
    core): this decodes its LevelDB-style log (7-byte header, 32 KiB blocks of checksummed
    chunks) into wandb's own protobuf ``Record``.
    """
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))):
        data, pos, chunk = Path(path).read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:
                break
            chunk, pos = (chunk if kind in (3, 4) else b"") + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunk)
                if record.WhichOneof("record_type") == "history":
                    items = record.history.item  # "a/b" keys arrive as nested_key ["a", "b"]
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.mark.slow
def test_offline_wandb_run_gets_the_metrics_jsonl_scalars_and_the_resume_continues_it(resumed_run):
    pytest.importorskip("wandb")
    run_id = json.loads((resumed_run / "trackers.json").read_text())["wandb"]
    files = glob.glob(str(resumed_run / "wandb" / "offline-run-*"))
    assert len(files) == 2 and all(f.endswith(run_id) for f in files), f"two runs, one W&B run id: {files}"
    got: dict[str, dict[int, float]] = {}
    for row in wandb_history(resumed_run, run_id):
        for tag, value in row.items():
            if "epoch" in row and "/" in tag:
                got.setdefault(tag, {})[row["epoch"]] = value
    expected = epoch_curves(resumed_run)
    assert set(got) == set(expected)
    for tag, values in expected.items():
        assert got[tag] == pytest.approx(values, rel=1e-6), tag
    assert sorted(got["val/top1"]) == [1, 2], "the resumed process appended epoch 2 to the same run"


@pytest.mark.slow
def test_local_mlflow_run_gets_the_metrics_jsonl_scalars_and_the_resume_continues_it(resumed_run):
    pytest.importorskip("mlflow")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file:" + str(resumed_run / "mlruns"))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [json.loads((resumed_run / "trackers.json").read_text())["mlflow"]]
    run_id = runs[0].info.run_id
    for tag, values in epoch_curves(resumed_run).items():
        history = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        assert history == pytest.approx(values, rel=1e-6), tag
    assert runs[0].data.params["OPTIM.WEIGHT_DECAY"] == "0.0001"  # the merged config
    windows = logged_windows(resumed_run)
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train_step/loss")}
    assert sorted(losses) == sorted(windows) and all(abs(losses[s] - windows[s][0]) < 6e-5 for s in windows)


def test_each_tracker_says_which_run_it_started_then_resumed_and_where(resumed_run):
    if not TRACKERS:
        pytest.skip("neither wandb nor mlflow is installed")
    ids, log = json.loads((resumed_run / "trackers.json").read_text()), (resumed_run / "log.txt").read_text()
    for name in TRACKERS:
        said = re.findall(rf"LOG.TRACKERS: {name} run (\S+) (started|resumed), in (.+)", log)
        assert [(run, verb) for run, verb, _ in said] == [(ids[name], "started"), (ids[name], "resumed")], said
        where = said[0][2]
        if name == "wandb":  # the offline run's folder, the one `wandb sync` uploads
            assert re.fullmatch(rf"{resumed_run}/wandb/offline-run-\S+-{ids[name]} \(offline: .*\)", where), where
        else:
            assert where == f"file:{resumed_run / 'mlruns'}", where


def test_a_tracking_uri_is_logged_without_its_credentials():
    from distribuuuu.records.tracking import _without_credentials

    assert _without_credentials("https://me:s3cret@mlflow.example.com:5000/x") == "https://mlflow.example.com:5000/x"
    assert _without_credentials("file:/runs/mlruns") == "file:/runs/mlruns"


def test_a_tracker_that_is_not_installed_is_one_warning_and_the_run_finishes(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as if not installed
    out = tmp_path / "out"
    result = in_process(TRAIN, *DUMMY_OPTS, "OUT_DIR", str(out), "LOG.TRACKERS", "['wandb']")
    assert_ok(result)
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if "not installed" in line]
    assert len(warnings) == 1 and "LOG.TRACKERS: wandb is not installed" in warnings[0], warnings
    assert "Traceback" not in result.stderr
    assert [r["split"] for r in read_metrics(out)] == ["train", "val"]


# ------------------------------------------------------------------------------------------------
# TensorBoard and the summary
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensorboard_has_the_window_curves_and_no_bookkeeping_tags(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed_run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    windows_telemetry = {
        f"train_step/{k}" for k in ("data_share", "step_s_min", "step_s_median", "step_s_max", "tflops")
    }
    assert tags == set(epoch_curves(resumed_run)) | {"train_step/loss", "train_step/lr", "train_step/images_per_s"} | (
        windows_telemetry
    )  # and no MFU: LOG.PEAK_TFLOPS is 0
    windows = logged_windows(resumed_run)
    assert sorted(windows) == [5, 10, 11, 16, 21, 22]  # every PRINT_FREQ step and each epoch's last
    for i, name in enumerate(("loss", "lr", "images_per_s")):
        points = {e.step: e.value for e in events.Scalars(f"train_step/{name}")}
        assert sorted(points) == sorted(windows)
        for step, printed in windows.items():  # the log line rounds: compare at its precision
            assert points[step] == pytest.approx(printed[i], rel=1e-3, abs=0.6 if name == "images_per_s" else 6e-5)
    for tag, values in epoch_curves(resumed_run).items():
        assert {e.step: e.value for e in events.Scalars(tag)} == pytest.approx(values, rel=1e-6)


@pytest.mark.slow
def test_the_run_summary_reports_the_metrics_and_the_config_changes(resumed_run):
    records = read_metrics(resumed_run)
    val = [r for r in records if r["split"] == "val"]
    train = [r for r in records if r["split"] == "train"]
    text = (resumed_run / "summary.md").read_text()
    best = max(val, key=lambda r: r["top1"])
    assert f"best val top-1: {best['top1']:.2f}% (model weights, epoch {best['epoch']}; checkpoints/" in text
    assert f"last val top-1 (model): {val[-1]['top1']:.2f}%" in text
    assert f"{sum(r['time_s'] for r in train):.1f} s training" in text
    assert f"{sum(r['samples'] for r in train) / sum(r['time_s'] for r in train):.0f} images/s" in text
    assert "`OPTIM.WEIGHT_DECAY`: 0.0001 (default 5e-05)" in text and "`TRAIN.SPLIT`: 'val' (default 'train')" in text
    assert "`TRAIN.BATCH_SIZE`" not in text  # left at its default
    if importlib.util.find_spec("matplotlib"):
        assert (resumed_run / "metrics.png").stat().st_size > 0
    result = in_process(SUMMARIZE, str(resumed_run))
    assert_ok(result)
    assert result.stdout == text == (resumed_run / "summary.md").read_text()  # the tool's report is the trainer's
    bad = in_process(SUMMARIZE, str(resumed_run / "nothing"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "metrics.jsonl" in bad.stderr


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(resumed_run, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    prefix = tmp_path_factory.mktemp("export") / "digits"
    result = in_process(
        EXPORT, "--weights", str(resumed_run / "best.pth.tar"), "--out", str(prefix), "--max-check", "0"
    )
    assert_ok(result)
    return prefix, result


def pytorch_logits(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every val image through the checkpoint's model in PyTorch (the reference), with the inputs."""
    sys.path.insert(0, str(REPO / "tools"))
    import predict

    state = predict.load_state(str(checkpoint))
    cfg = predict.build_cfg(state, None, ())
    model = predict.load_model(state, cfg, "model", torch.device("cpu"))
    images = predict.find_images([str(VAL)])
    from distribuuuu.data import load_image
    from distribuuuu.training.preprocessing import build_val_transform

    transform = build_val_transform(cfg)
    inputs = torch.stack([transform(load_image(p, "pil")) for p in images])
    with torch.no_grad():
        return inputs, model(inputs)


def onnx_graph(prefix):
    import onnx

    return onnx.load(f"{prefix}.onnx").graph


@pytest.mark.slow
def test_onnx_and_torch_export_agree_with_pytorch_on_every_val_image(resumed_run, exported):
    import onnxruntime

    prefix, result = exported
    inputs, reference = pytorch_logits(resumed_run / "best.pth.tar")
    assert len(inputs) == 361
    session = onnxruntime.InferenceSession(f"{prefix}.onnx", providers=["CPUExecutionProvider"])
    graph = onnx_graph(prefix)
    shapes = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)]
    assert shapes == [["batch", 3, 16, 16], ["batch", 10]], "a named dynamic batch dimension, as deployers read it"
    for batch in (1, 7):  # the batch dimension is dynamic
        for start in (0, 7, 354):
            out = session.run(["logits"], {"images": inputs[start : start + batch].numpy()})[0]
            assert out.shape == (batch, 10)
            assert torch.allclose(torch.from_numpy(out), reference[start : start + batch], atol=1e-3)
    onnx_probs = torch.cat([torch.from_numpy(session.run(None, {"images": c.numpy()})[0]) for c in inputs.split(50)])
    assert torch.equal(onnx_probs.argmax(1), reference.argmax(1))
    program = torch.export.load(f"{prefix}.pt2").module()
    with torch.no_grad():
        assert torch.equal(program(inputs).argmax(1), reference.argmax(1))
    for name in ("onnx", "torch.export"):
        assert f"{name}: top-1 agrees with PyTorch on 361/361 images" in result.stdout


@pytest.mark.slow
def test_the_preprocessing_is_stated_beside_and_inside_the_exports(resumed_run, exported):
    import onnx

    prefix, _ = exported
    meta = json.loads(Path(f"{prefix}.json").read_text())
    cfg = load_cfg(str(resumed_run / "config.yaml"))
    assert (meta["resize"], meta["crop"], meta["mean"], meta["std"]) == (16, 16, cfg.DATA.MEAN, cfg.DATA.STD)
    assert meta["classes"] == sorted(p.name for p in VAL.iterdir()) and meta["interpolation"] == "bilinear"
    props = {p.key: p.value for p in onnx.load(f"{prefix}.onnx").metadata_props}
    assert json.loads(props["distribuuuu.preprocessing"]) == meta
    extra = {"preprocessing.json": ""}
    torch.export.load(f"{prefix}.pt2", extra_files=extra)
    assert json.loads(extra["preprocessing.json"]) == meta


# ------------------------------------------------------------------------------------------------
# Export, predict and test_net: the run's own evaluation preprocessing; sharded checkpoints
# ------------------------------------------------------------------------------------------------
# Evaluation keys of its own (a crop between the train size and the resize, bicubic), written as
# sharded checkpoints (best.dcp, with EMA weights) by one process. The preprocessing is the model's
# business in none of the tools: the tiny registered CNN (its export: 2 s; the light torchvision
# model's above: 12 s), registered here too for the tools this module runs in its own process.
EVAL_KEYS_OPTS = [
    *EVAL_TINY, "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "10", "TRAIN.SPLIT", "val", "TEST.IM_SIZE", "20", "TEST.CROP_SIZE", "18", "TEST.INTERPOLATION", "bicubic",
    "DIST.CKPT_FORMAT", "sharded", "OPTIM.EMA_DECAY", "0.9",
]  # fmt: skip


@pytest.fixture(scope="module")
def eval_keys_run(tmp_path_factory) -> Path:
    """The run's OUT_DIR, with best.dcp converted to a single file too (best.pth.tar)."""
    from distribuuuu.training.convert import to_single_file

    out = tmp_path_factory.mktemp("eval_keys")
    assert_ok(in_process(TINY_TRAIN, *EVAL_KEYS_OPTS, "OUT_DIR", str(out), env=lone_env()))
    to_single_file(str(out / "best.dcp"), str(out / "best.pth.tar"))
    return out


def export_in_process(*argv: str) -> str:
    """tools/export.py's main here (no interpreter start-up); asserts exit 0 and returns its stdout."""
    sys.path.insert(0, str(REPO / "tools"))
    import export

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = export.main(list(argv))
    assert status == 0, printed.getvalue()
    return printed.getvalue()


@pytest.fixture(scope="module")
def onnx_probs(eval_keys_run, tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Export best.pth.tar; onnxruntime's class probabilities per val image, fed as the JSON says."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    prefix = tmp_path_factory.mktemp("export_eval_keys") / "model"
    printed = export_in_process(
        "--weights", str(eval_keys_run / "best.pth.tar"), "--out", str(prefix), "--check", str(VAL)
    )
    meta = json.loads(Path(f"{prefix}.json").read_text())
    session = onnxruntime.InferenceSession(f"{prefix}.onnx", providers=["CPUExecutionProvider"])
    paths = sorted(str(p) for p in VAL.rglob("*.png"))
    logits = [session.run(["logits"], {"images": as_the_json_says(meta, p)[None].numpy()})[0][0] for p in paths]
    return meta, {p: torch.from_numpy(out).softmax(0) for p, out in zip(paths, logits)}, printed


def as_the_json_says(meta: dict, path: str) -> torch.Tensor:
    """A deployment's preprocessing, written from the JSON alone with torchvision's functional ops."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    pixels = decode_image(path, mode=ImageReadMode.RGB)
    mode = InterpolationMode(meta["interpolation"])
    pixels = F.center_crop(
        F.resize(pixels, meta["resize"], interpolation=mode, antialias=meta["antialias"]), meta["crop"]
    )
    mean, std = torch.tensor(meta["mean"]).view(3, 1, 1), torch.tensor(meta["std"]).view(3, 1, 1)
    return (pixels.float() / 255 - mean) / std


def score_with_test_net(out_dir: Path, weights: Path, tmp_path: Path) -> tuple[float, int, str]:
    """tools/test_net.py's entry point here with the run's config: (top-1 %, images, its log)."""
    from distribuuuu.logger import LOG_NAME
    from distribuuuu.trainer import test_model

    cfg = load_cfg(str(out_dir / "config.yaml"), ["MODEL.WEIGHTS", str(weights), "OUT_DIR", str(tmp_path)])
    try:
        totals = test_model(cfg)
    finally:
        for handler in list(logging.getLogger(LOG_NAME).handlers):
            handler.close()
            logging.getLogger(LOG_NAME).removeHandler(handler)
    return totals["top1_acc"], totals["samples"], (tmp_path / "log.txt").read_text()


@pytest.mark.slow
def test_the_export_states_the_runs_eval_crop_and_onnx_fed_as_its_json_says_scores_val_as_test_net(
    eval_keys_run, onnx_probs, tmp_path
):
    meta, probs, printed = onnx_probs
    cfg = load_cfg(str(eval_keys_run / "config.yaml"))
    assert (meta["resize"], meta["crop"], meta["interpolation"]) == (20, 18, "bicubic")
    assert (meta["mean"], meta["std"]) == (list(cfg.DATA.MEAN), list(cfg.DATA.STD))
    assert "onnx: top-1 agrees with PyTorch on 256/256 images" in printed  # --max-check's default
    correct = sum(meta["classes"][int(p.argmax())] == Path(path).parent.name for path, p in probs.items())
    acc, samples, log = score_with_test_net(eval_keys_run, eval_keys_run / "best.dcp", tmp_path)
    assert samples == len(probs) == 361 and "was validated with" not in log
    assert 100.0 * correct / samples == pytest.approx(acc, abs=1e-9)
    epoch = torch.load(eval_keys_run / "best.pth.tar", weights_only=True)["epoch"]  # best.dcp's, converted
    val = [r for r in read_metrics(eval_keys_run) if r["split"] == "val" and r["weights"] == "model"]
    validated = [r["top1"] for r in val if r["epoch"] == epoch]
    assert [acc] == pytest.approx(validated, abs=1e-9), "test_net scores best.dcp as validation scored it"


@pytest.mark.slow
def test_predict_on_a_sharded_checkpoint_gives_the_exports_top1_per_image(eval_keys_run, onnx_probs, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import predict

    meta, probs, _ = onnx_probs
    assert predict.main(["--weights", str(eval_keys_run / "best.dcp"), str(VAL), "--json", "--topk", "1"]) == 0
    top1 = {r["path"]: r["topk"][0] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {path: t["class"] for path, t in top1.items()} == {
        path: meta["classes"][int(p.argmax())] for path, p in probs.items()
    }
    assert all(abs(t["prob"] - float(probs[path].max())) < 1e-5 for path, t in top1.items()), "the same numbers"


@pytest.mark.slow
def test_a_sharded_checkpoints_ema_weights_export_with_the_parity_check(eval_keys_run, onnx_probs, tmp_path):
    pytest.importorskip("onnxscript")
    weights = str(eval_keys_run / "best.dcp")
    printed = export_in_process("--weights", weights, "--ema", "--out", str(tmp_path / "e"), "--check", str(VAL))
    for name in ("onnx", "torch.export"):
        assert f"{name}: top-1 agrees with PyTorch on 256/256 images" in printed, printed
    meta = json.loads((tmp_path / "e.json").read_text())
    assert meta["weights"] == "ema" and {**meta, "weights": "model"} == onnx_probs[0]
    sys.path.insert(0, str(REPO / "tools"))
    import predict

    state = predict.load_state(str(eval_keys_run / "best.dcp"))
    cfg, cpu = predict.build_cfg(state, None, ()), torch.device("cpu")
    ema, raw = (predict.load_model(state, cfg, kind, cpu) for kind in ("ema", "model"))
    program = torch.export.load(str(tmp_path / "e.pt2")).module()
    inputs = torch.stack([as_the_json_says(meta, str(p)) for p in sorted(VAL.rglob("*.png"))[:64]])
    with torch.no_grad():
        assert torch.allclose(program(inputs), ema(inputs), atol=1e-4), "the EMA weights were exported"
        assert not torch.allclose(raw(inputs), ema(inputs), atol=1e-4), "and they differ from the raw ones"


@pytest.mark.slow
def test_a_checkpoint_without_stored_preprocessing_resolves_it_from_its_config(eval_keys_run):
    from distribuuuu.data.transforms import EvalPreprocessing
    from distribuuuu.training.preprocessing import checkpoint_preprocessing, eval_preprocessing

    state = torch.load(eval_keys_run / "best.pth.tar", weights_only=True)
    stored = EvalPreprocessing.from_dict(state.pop("preprocessing"))
    assert stored == eval_preprocessing(load_cfg(str(eval_keys_run / "config.yaml")))
    assert (stored.resize, stored.crop, stored.interpolation) == (20, 18, "bicubic")
    assert checkpoint_preprocessing(state) == stored  # an older checkpoint: resolved from its cfg


def test_predict_preprocesses_as_stored_unless_its_keys_change_an_eval_key(monkeypatch):
    """The stored preprocessing wins over a re-resolution of the same keys; KEY VALUE pairs that
    change an evaluation key are resolved as validation would, over the rest of the checkpoint's."""
    sys.path.insert(0, str(REPO / "tools"))
    import predict

    from distribuuuu.data.transforms import EvalPreprocessing
    from distribuuuu.training import resume as state_module
    from distribuuuu.training.resume import warn_if_evaluated_otherwise

    cfg = load_cfg(
        opts=["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "20", "TEST.CROP_SIZE", "18", "TEST.INTERPOLATION", "bicubic"]
    )
    stored = EvalPreprocessing(resize=21, crop=18, interpolation="bicubic", mean=(0.5,) * 3, std=(0.25,) * 3)
    state = {"cfg": cfg.dump(), "classes": list("0123456789"), "preprocessing": stored.as_dict()}
    assert predict.resolve_preprocessing(state, None, ()) == stored
    assert predict.resolve_preprocessing(state, None, ["DATA.DECODER", "pil"]) == stored
    changed = predict.resolve_preprocessing(state, None, ["TEST.CROP_SIZE", "16"])
    assert (changed.resize, changed.crop, changed.interpolation) == (20, 16, "bicubic")
    del state["preprocessing"]  # a checkpoint written before it was stored
    mean, std = tuple(cfg.DATA.MEAN), tuple(cfg.DATA.STD)
    assert predict.resolve_preprocessing(state, None, ()) == EvalPreprocessing(20, 18, "bicubic", mean, std)
    warned: list[str] = []  # test_net's warning, whatever handlers earlier tests left on the loggers
    monkeypatch.setattr(state_module.logger, "warning", lambda msg, *args: warned.append(msg % args))
    warn_if_evaluated_otherwise(state, cfg, "same.pth.tar")
    warn_if_evaluated_otherwise(state, get_cfg_defaults(), "other.pth.tar")
    assert [w.split(" ")[0] for w in warned] == ["other.pth.tar"] and "'crop': 18" in warned[0]


class Unexportable(torch.nn.Module):
    """A data-dependent branch: torch.export cannot trace it."""

    def __init__(self, num_classes: int = 10, pretrained: bool = False):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.mean((2, 3))
        return self.head(pooled) if pooled.sum() > 0 else -self.head(pooled)


def test_export_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    pytest.importorskip("onnxscript")
    sys.path.insert(0, str(REPO / "tools"))
    import export

    missing = in_process(EXPORT, "--weights", str(tmp_path / "none.pth.tar"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"export.py: error: checkpoint not found: {tmp_path / 'none.pth.tar'}"
    ]
    register_model("unexportable_test_net")(Unexportable)
    cfg = get_cfg_defaults()
    cfg.MODEL.ARCH = "unexportable_test_net"
    state = {"model": Unexportable().state_dict(), "classes": list("0123456789"), "cfg": cfg.dump()}
    torch.save(state, tmp_path / "bad.pth.tar")
    assert export.main(["--weights", str(tmp_path / "bad.pth.tar"), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export.py: error: unexportable_test_net cannot be exported"), err


# ------------------------------------------------------------------------------------------------
# The progress bar
# ------------------------------------------------------------------------------------------------
def run_on_pty(cmd: list[str], timeout: float = 300) -> str:
    """Run ``cmd`` (as ``run`` would) with stdout on a pseudo-terminal; return
    what it printed there."""
    master, slave = pty.openpty()
    chunks, deadline = [], time.monotonic() + timeout
    with Started(cmd, stdout=slave) as proc:
        os.close(slave)
        try:
            while time.monotonic() < deadline:
                if select.select([master], [], [], 1.0)[0]:
                    try:
                        data = os.read(master, 65536)
                    except OSError:  # EIO: the child closed the terminal
                        break
                    if not data:
                        break
                    chunks.append(data)
                elif proc.poll() is not None:
                    break
            code = proc.result(30).returncode
        finally:
            os.close(master)
    assert code == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


BAR = re.compile(r"\r\x1b\[Kepoch 1/1 \[[#.]{24}\] (\d)/4  loss \d+\.\d{4}  \d+ img/s  eta \d+:\d\d:\d\d")


@pytest.mark.slow
def test_the_progress_bar_shows_on_a_terminal_and_not_when_redirected(tmp_path):
    # A launch: the property is what the process draws on its own terminal (its stdout a pty).
    shown = run_on_pty(python(TRAIN, *DUMMY_OPTS, "OUT_DIR", str(tmp_path / "tty")))
    assert [int(m.group(1)) for m in BAR.finditer(shown)] == [1, 2, 3, 4]  # one redraw per sync point
    assert "step 1/4" not in shown and "val model epoch 1" in shown  # windows as the bar, the rest as lines
    assert len(re.findall(r"step \d/4", (tmp_path / "tty" / "log.txt").read_text())) == 4  # log.txt keeps them
    redirected = in_process(TRAIN, *DUMMY_OPTS, "OUT_DIR", str(tmp_path / "pipe"))  # stdout: a file, here
    assert_ok(redirected)
    assert not BAR.search(redirected.stdout) and "\r" not in redirected.stdout
    assert len(re.findall(r"step \d/4", redirected.stdout)) == 4


def test_the_loop_with_a_real_writer_and_the_bar_syncs_only_at_sync_points(tmp_path):
    """The hot-loop check of test_hot_loop.py, with TensorBoard windows and the bar drawing."""
    import hot_loop_helpers as hot

    from distribuuuu.logger import setup_logging

    batches = list(hot._digits_run(hot.DistEnv()).train.loader)
    log = setup_logging(str(tmp_path), 0, progress_bar=True)
    writer = MetricsWriter(str(tmp_path))
    try:
        with hot.one_rank_group():
            run_ = hot.with_batches(hot._digits_run(hot.DistEnv()), batches)
            calls = hot.record_epoch(run_, writer=writer)
    finally:
        writer.close()
        for handler in list(log.handlers):
            handler.close()
            log.removeHandler(handler)
    hot.check_collectives(calls)
    hot.check_host_syncs(calls)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_step/loss")] == hot.SYNC_STEPS
