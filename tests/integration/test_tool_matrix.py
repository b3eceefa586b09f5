"""Every tool takes every checkpoint form and every dataset form: one table of combinations.

Checkpoints: single files (``best.pth.tar``, ``checkpoints/ckpt_ep_001.pth.tar``) of a ddp run and
sharded folders (``best.dcp``, ``checkpoints/ckpt_ep_001.dcp``) of a 2-rank fsdp run, each with raw
and EMA weights. Datasets: an ImageFolder, its packed shards on disk and over HTTP, and a saved
Hugging Face dataset. Each tool's numbers are compared with an independent computation: the
run's own validation record (2 ranks, sharded, for the fsdp run), the checkpoint converted by
convert_checkpoint.py, test_net's count for predict.py's per-image top-1, PyTorch for the exports.
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import (
    EVAL_TINY,
    REPO,
    TEST,
    TINY_ARCH,
    TINY_TRAIN,
    TRAIN,
    assert_ok,
    in_process,
    read_metrics,
    run_torchrun,
    serve_folder,
)

pytest.importorskip("wids")
datasets = pytest.importorskip("datasets")
# The tools read any model's checkpoints alike: the tiny registered CNN keeps each export at ~2 s
# (the light torchvision model's took ~12 s); tests/integration/test_export_and_tracking.py exports that one.


TOOLS = REPO / "tools"
PREDICT, EXPORT, CONVERT, SUMMARIZE = (
    str(TOOLS / f"{n}.py") for n in ("predict", "export", "convert_checkpoint", "summarize")
)
DIGITS = REPO / "data" / "digits"
PER_CLASS = {"train": 6, "val": 4}  # 60 training and 40 val images: a few steps per epoch
# One epoch at a high LR: weights that predict different classes for different images, and EMA
# weights that differ from the raw ones, so that a wrong checkpoint or kind shows in the numbers.
RUN_OPTS = [
    *EVAL_TINY, "OPTIM.MAX_EPOCH", "1", "OPTIM.BASE_LR", "0.4", "OPTIM.EMA_DECAY", "0.5", "TRAIN.BATCH_SIZE", "8",
    "TEST.BATCH_SIZE", "8", "TRAIN.WORKERS", "0", "TRAIN.PRINT_FREQ", "2", "LOG.PLOT", "False",
]  # fmt: skip
FORMS = ("folder", "packed", "http", "hf")
KINDS = ("model", "ema")


@pytest.fixture(autouse=True)
def shard_cache_in_tmp(tmp_path, monkeypatch):
    """Readers built in this process keep their shard links under the test's tmp_path, not in /tmp."""
    monkeypatch.setattr("distribuuuu.data.packed.default_cache_dir", lambda root: str(tmp_path / "shard-cache"))


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, str]:
    """A small copy of data/digits in the four forms TRAIN.DATASET / TEST.DATASET take."""
    root = tmp_path_factory.mktemp("forms")
    folder = root / "folder"
    for split, count in PER_CLASS.items():
        for class_dir in sorted((DIGITS / split).iterdir()):
            (folder / split / class_dir.name).mkdir(parents=True)
            for image in sorted(class_dir.iterdir())[:count]:
                shutil.copy(image, folder / split / class_dir.name / image.name)
    # In ImageFolder's order (--no-shuffle): fine-tuning on the packed forms then draws the same batches as
    # on the folder, which the fine-tuning rows compare bit for bit.
    assert_ok(in_process(str(TOOLS / "pack_dataset.py"), str(folder), str(root / "packed"), "--no-shuffle"))
    save_hf(folder, root / "hf")
    with serve_folder(root / "packed") as url:
        yield {"folder": str(folder), "packed": str(root / "packed"), "http": url, "hf": str(root / "hf")}


def save_hf(folder: Path, out: Path) -> None:
    """``folder`` as a Hugging Face DatasetDict saved with save_to_disk (images embedded as bytes)."""
    from distribuuuu.data.datasets import CheckedImageFolder

    splits = {}
    for split in PER_CLASS:
        images = CheckedImageFolder(str(folder / split))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=images.classes)})
        rows = {"image": [{"bytes": Path(p).read_bytes(), "path": None} for p, _ in images.samples]}
        splits[split] = datasets.Dataset.from_dict({**rows, "label": images.targets}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(out))


def data(root: str) -> list[str]:
    return ["TRAIN.DATASET", root, "TEST.DATASET", root]


@pytest.fixture(scope="module")
def runs(forms, tmp_path_factory) -> dict[str, Path]:
    """One 2-rank fsdp run (sharded checkpoints) and one single-process ddp run (files), with EMA."""
    out = tmp_path_factory.mktemp("runs")
    fsdp = [*RUN_OPTS, *data(forms["folder"]), "DIST.STRATEGY", "fsdp", "OUT_DIR", str(out / "fsdp")]
    assert_ok(run_torchrun(2, TINY_TRAIN, *fsdp, timeout=300))
    assert_ok(in_process(TRAIN, *RUN_OPTS, *data(forms["folder"]), "OUT_DIR", str(out / "ddp")))
    return {"fsdp": out / "fsdp", "ddp": out / "ddp"}


CHECKPOINTS = {
    "file": ("ddp", "best.pth.tar"),
    "file_epoch": ("ddp", "checkpoints/ckpt_ep_001.pth.tar"),
    "dcp": ("fsdp", "best.dcp"),
    "dcp_epoch": ("fsdp", "checkpoints/ckpt_ep_001.dcp"),
}


def checkpoint(runs: dict[str, Path], name: str) -> str:
    run_name, relative = CHECKPOINTS[name]
    path = runs[run_name] / relative
    assert path.exists(), f"the {run_name} run wrote no {relative}"
    return str(path)


def validated(runs: dict[str, Path], name: str, kind: str) -> dict:
    """The run's own validation of ``kind`` weights at its one epoch: the independent reference."""
    records = read_metrics(runs[CHECKPOINTS[name][0]])
    [record] = [r for r in records if r["split"] == "val" and r["weights"] == kind]
    return record


def run_test_net(weights: str, kind: str, dataset: str, out_dir: Path) -> dict:
    """test_net.py in this process: its ``test`` record."""
    result = in_process(TEST, *EVAL_TINY, "TEST.DATASET", dataset, "TEST.BATCH_SIZE", "8", "MODEL.WEIGHTS", weights,
                        "MODEL.WEIGHTS_KIND", kind, "OUT_DIR", str(out_dir))  # fmt: skip
    assert_ok(result)
    return read_metrics(out_dir)[-1]


def test_runs_learn_something_to_compare(runs):
    for name in ("file", "dcp"):
        model, ema = (validated(runs, name, kind) for kind in KINDS)
        assert model["samples"] == ema["samples"] == 10 * PER_CLASS["val"]
        assert model["loss"] != pytest.approx(ema["loss"], abs=1e-4), "EMA weights must differ from the raw ones"


# ------------------------------------------------------------------------------------------------
# test_net.py: every checkpoint form x weights kind x dataset form scores as the run validated
# ------------------------------------------------------------------------------------------------
TEST_NET_ROWS = [(c, k, "folder") for c in CHECKPOINTS for k in KINDS] + [
    (c, k, f) for c in ("file", "dcp") for k in KINDS for f in FORMS if f != "folder"
]


@pytest.mark.parametrize(("name", "kind", "form"), TEST_NET_ROWS)
def test_test_net_scores_each_checkpoint_and_dataset_form_as_the_run_validated(runs, forms, name, kind, form, tmp_path):
    record = run_test_net(checkpoint(runs, name), kind, forms[form], tmp_path)
    reference = validated(runs, name, kind)
    assert record["weights"] == kind and record["samples"] == reference["samples"]
    assert record["top1"] == pytest.approx(reference["top1"], abs=1e-9)
    assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# convert_checkpoint.py: both directions, read back by test_net
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("dcp", "best.pth.tar"),
        pytest.param("dcp_epoch", "ep.pth.tar", marks=pytest.mark.slow),
        pytest.param("file", "x.dcp", marks=pytest.mark.slow),
    ],
)
def test_converted_checkpoints_score_as_their_source(runs, forms, name, target, tmp_path):
    """Each direction, each weights kind: test_net scores the converted checkpoint as the source's
    run validated it (and as it scores the source itself: the rows above)."""
    converted = tmp_path / target
    with warnings.catch_warnings(record=True) as caught:  # what would reach a user's stderr
        warnings.simplefilter("always")
        result = in_process(CONVERT, checkpoint(runs, name), str(converted))
    assert_ok(result)
    assert result.stdout == f"wrote {converted}\n" and not result.stderr.strip(), result.stderr
    assert not [str(w.message) for w in caught if "torch.distributed" in str(w.message)], "one process by design"
    for kind in KINDS:
        record = run_test_net(str(converted), kind, forms["folder"], tmp_path / f"converted_{kind}")
        reference = validated(runs, name, kind)
        assert (record["top1"], record["samples"]) == (reference["top1"], reference["samples"])
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# predict.py: every checkpoint form x kind x dataset form; its per-image top-1 is test_net's count
# ------------------------------------------------------------------------------------------------
@functools.cache  # the folder's predictions are every other form's reference
def predict(weights: str, kind: str, path: str) -> list[dict]:
    result = in_process(PREDICT, "--weights", weights, "--json", "--topk", "1", *(["--ema"] * (kind == "ema")), path)
    assert_ok(result)
    return [json.loads(line) for line in result.stdout.splitlines()]


def truths(forms: dict[str, str]) -> list[str]:
    """The class of each val image, in the ImageFolder's (and so every form's) order."""
    return [p.parent.name for p in sorted(Path(forms["folder"], "val").rglob("*.png"))]


PREDICT_ROWS = [(c, k, f) for c in ("file", "dcp") for k in KINDS for f in FORMS] + [
    (c, "ema", "folder") for c in ("file_epoch", "dcp_epoch")
]


@pytest.mark.parametrize(("name", "kind", "form"), PREDICT_ROWS)
def test_predict_top1_per_image_agrees_with_test_nets_count(runs, forms, name, kind, form):
    root = forms[form]
    records = predict(checkpoint(runs, name), kind, str(Path(root, "val")) if form == "folder" else root)
    classes = truths(forms)
    assert len(records) == len(classes), "every val image once"
    correct = sum(r["topk"][0]["class"] == truth for r, truth in zip(records, classes))
    reference = validated(runs, name, kind)
    assert 100.0 * correct / len(records) == pytest.approx(reference["top1"], abs=1e-9)
    if form != "folder":  # the same images, the same order, the same numbers as from the folder
        folder = predict(checkpoint(runs, name), kind, str(Path(forms["folder"], "val")))
        assert [r["topk"] for r in records] == [r["topk"] for r in folder]


# ------------------------------------------------------------------------------------------------
# export.py: file and sharded, raw and EMA; checked on each dataset form; ONNX agrees with torch
# ------------------------------------------------------------------------------------------------
EXPORT_ROWS = [
    ("file", "model", "folder"),
    ("dcp", "ema", "http"),
    ("file", "ema", "hf"),
    ("dcp_epoch", "model", "packed"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kind", "form"), EXPORT_ROWS)
def test_export_of_each_checkpoint_form_agrees_with_pytorch_on_each_dataset_form(
    runs, forms, name, kind, form, tmp_path
):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    root = forms[form]
    check = str(Path(root, "val")) if form == "folder" else root
    args = ["--weights", checkpoint(runs, name), "--out", str(tmp_path / "m"), "--check", check]
    result = in_process(EXPORT, *args, *(["--ema"] * (kind == "ema")))
    assert_ok(result)
    images = 10 * PER_CLASS["val"]
    for fmt in ("onnx", "torch.export"):
        assert f"{fmt}: top-1 agrees with PyTorch on {images}/{images} images" in result.stdout, result.stdout
    assert json.loads((tmp_path / "m.json").read_text())["weights"] == kind


@pytest.mark.slow
def test_export_checks_on_the_checkpoints_own_packed_val_split_by_default(runs, forms, tmp_path):
    """No --check: the checkpoint's own TEST.DATASET, here shards over HTTP (not a folder)."""
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    out = tmp_path / "packed_run"
    assert_ok(in_process(TRAIN, *RUN_OPTS, *data(forms["http"]), "OPTIM.EMA_DECAY", "0", "OUT_DIR", str(out)))
    result = in_process(EXPORT, "--weights", str(out / "best.pth.tar"), "--out", str(tmp_path / "m"))
    assert_ok(result)
    assert "onnx: top-1 agrees with PyTorch on 40/40 images" in result.stdout, result.stdout


# ------------------------------------------------------------------------------------------------
# MODEL.WEIGHTS / fine-tuning: every checkpoint form x kind, every dataset form
# ------------------------------------------------------------------------------------------------
def fine_tune(weights: str, kind: str, dataset: str, out_dir: Path) -> dict:
    """One epoch from ``weights``; its val record (the raw weights)."""
    opts = [*RUN_OPTS, *data(dataset), "OPTIM.EMA_DECAY", "0", "MODEL.WEIGHTS", weights, "MODEL.WEIGHTS_KIND", kind]
    assert_ok(in_process(TRAIN, *opts, "OPTIM.BASE_LR", "0.05", "OUT_DIR", str(out_dir)))
    [record] = [r for r in read_metrics(out_dir) if r["split"] == "val"]
    return record


FINE_TUNE_ROWS = [("dcp", "ema", f) for f in FORMS] + [("file", "model", "packed"), ("dcp_epoch", "model", "hf")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kind", "form"), FINE_TUNE_ROWS)
def test_fine_tuning_from_each_checkpoint_form_on_each_dataset_form_trains_as_from_the_file(
    runs, forms, fine_tuned_from_file, name, kind, form, tmp_path
):
    """The same weights (a .dcp, or a file converted from it), the same batches (any form): the same run."""
    record = fine_tune(checkpoint(runs, name), kind, forms[form], tmp_path / "from_form")
    reference = fine_tuned_from_file(name, kind)
    assert (record["top1"], record["samples"]) == (reference["top1"], reference["samples"])
    assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    untrained = fine_tuned_from_file(name, "model" if kind == "ema" else "ema")
    assert untrained["loss"] != pytest.approx(reference["loss"], rel=1e-5), "the kind chose the weights"


@pytest.fixture(scope="module")
def fine_tuned_from_file(runs, forms, tmp_path_factory):
    """The reference of the rows above: fine-tuning from the checkpoint as a single file (converted
    from a .dcp) on the folder; computed once per (checkpoint, kind), as several rows share one."""
    done: dict[tuple[str, str], dict] = {}

    def reference(name: str, kind: str) -> dict:
        if (name, kind) not in done:
            tmp = tmp_path_factory.mktemp(f"reference_{name}_{kind}")
            as_file = checkpoint(runs, name)
            if as_file.endswith(".dcp"):
                as_file = str(tmp / "converted.pth.tar")
                assert_ok(in_process(CONVERT, checkpoint(runs, name), as_file))
            done[name, kind] = fine_tune(as_file, kind, forms["folder"], tmp / "out")
        return done[name, kind]

    return reference


# ------------------------------------------------------------------------------------------------
# summarize.py: both runs' OUT_DIRs (sharded and single-file checkpoints)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["file", "dcp"])
def test_summarize_reports_each_runs_best_validation(runs, name):
    result = in_process(SUMMARIZE, str(runs[CHECKPOINTS[name][0]]), "--no-write")
    assert_ok(result)
    best = max((validated(runs, name, kind) for kind in KINDS), key=lambda r: r["top1"])
    assert f"best val top-1: {best['top1']:.2f}%" in result.stdout, result.stdout
    assert TINY_ARCH in result.stdout
