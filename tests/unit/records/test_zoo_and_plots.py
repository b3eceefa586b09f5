"""The config zoo loads and is self-consistent; tools/plot_metrics.py draws and fails cleanly."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, clean_env, in_process

from distribuuuu.config import ConfigError, load_cfg

CONFIG_DIR = REPO / "config"
IMAGENET_DIR = CONFIG_DIR / "imagenet"
PLOT = REPO / "tools" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

ALL_YAMLS = sorted(CONFIG_DIR.rglob("*.yaml"))
IMAGENET_YAMLS = sorted(IMAGENET_DIR.glob("*.yaml"))

# Machine-readable header lines of every config/imagenet recipe, e.g.
#   # gpus: 64 = 8 nodes x 8 GPUs (one process per GPU)
#   # global_batch: 8192 = 128 x 64 GPUs  (TRAIN.BATCH_SIZE 128 per process)
#   # lr_rule: BASE_LR = 0.1 x global_batch / 128 = 6.4
GPUS_RE = re.compile(r"^# gpus: (\d+) = (\d+) nodes? x (\d+) GPUs", re.MULTILINE)
BATCH_RE = re.compile(r"^# global_batch: (\d+) = (\d+) x (\d+) GPUs", re.MULTILINE)
LR_RE = re.compile(r"^# lr_rule: BASE_LR = ([\d.]+) x global_batch / (\d+) = ([\d.]+(?:e-?\d+)?)", re.MULTILINE)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _header(path: Path, pattern: re.Pattern[str]) -> tuple[str, ...]:
    match = pattern.search(path.read_text())
    assert match, f"{_rel(path)}: header line matching {pattern.pattern!r} missing"
    return match.groups()


def test_zoo_is_not_empty() -> None:
    assert len(IMAGENET_YAMLS) >= 10, [_rel(p) for p in IMAGENET_YAMLS]


@pytest.mark.parametrize("path", ALL_YAMLS, ids=_rel)
def test_config_loads_and_validates(path: Path) -> None:
    try:
        load_cfg(str(path))
    except ConfigError as e:
        pytest.fail(f"{_rel(path)} does not load: {e}")


@pytest.mark.parametrize("path", IMAGENET_YAMLS, ids=_rel)
def test_recipe_header_matches_batch(path: Path) -> None:
    cfg = load_cfg(str(path))
    gpus, nodes, per_node = map(int, _header(path, GPUS_RE))
    global_batch, per_gpu, batch_gpus = map(int, _header(path, BATCH_RE))
    assert gpus == nodes * per_node, f"{_rel(path)}: gpus header is inconsistent"
    assert batch_gpus == gpus, f"{_rel(path)}: global_batch header assumes another GPU count"
    assert per_gpu == cfg.TRAIN.BATCH_SIZE, f"{_rel(path)}: header per-GPU batch != BATCH_SIZE"
    assert global_batch == cfg.TRAIN.BATCH_SIZE * gpus * cfg.TRAIN.ACCUM_STEPS, _rel(path)


@pytest.mark.parametrize("path", IMAGENET_YAMLS, ids=_rel)
def test_recipe_lr_follows_stated_linear_rule(path: Path) -> None:
    cfg = load_cfg(str(path))
    global_batch = int(_header(path, BATCH_RE)[0])
    ref_lr, ref_batch, stated_lr = _header(path, LR_RE)
    expected = float(ref_lr) * global_batch / int(ref_batch)
    assert math.isclose(cfg.OPTIM.BASE_LR, expected, rel_tol=1e-9), _rel(path)
    assert math.isclose(float(stated_lr), expected, rel_tol=1e-9), _rel(path)
    # BASE_LR is already scaled: the automatic rule must not scale it a second time
    assert cfg.OPTIM.REFERENCE_BATCH == 0, _rel(path)


@pytest.mark.parametrize("path", IMAGENET_YAMLS, ids=_rel)
def test_recipe_common_settings(path: Path) -> None:
    cfg = load_cfg(str(path))
    assert cfg.MODEL.NUM_CLASSES == 1000
    assert (cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT) == ("./data/ILSVRC", "train")
    assert (cfg.TEST.DATASET, cfg.TEST.SPLIT) == ("./data/ILSVRC", "val")
    assert cfg.TRAIN.TOPK == 5 and cfg.TRAIN.WORKERS == 8
    assert cfg.OUT_DIR == f"./output/{path.stem}"
    assert cfg.OPTIM.MAX_EPOCH == 100 and cfg.OPTIM.LR_POLICY == "cos"
    assert cfg.OPTIM.WARMUP_EPOCHS == 5 and cfg.OPTIM.NESTEROV


def _record(epoch: int, split: str, loss: float, **extra: object) -> dict[str, object]:
    record = {"epoch": epoch, "split": split, "loss": loss, "top1": 100 - 30 * loss}
    record.update(topk=100 - 5 * loss, k=5, images_per_s=1000.0 + epoch, time_s=3.0)
    record.update(samples=512, **extra)
    return record


def _write_run(out_dir: Path, epochs: int, with_ema: bool) -> Path:
    out_dir.mkdir(parents=True)
    lines = []
    for epoch in range(1, epochs + 1):
        loss = 2.0 / epoch
        lines.append(_record(epoch, "train", loss, lr=0.1 * (epochs - epoch + 1) / epochs))
        lines.append(_record(epoch, "val", loss * 0.9, weights="model"))
        if with_ema:
            lines.append(_record(epoch, "val", loss * 0.8, weights="ema"))
    lines.append(_record(2, "train", 0.9, lr=0.05))  # a resumed run repeats epoch 2
    lines.append(_record(epochs, "test", 0.5))
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out_dir


def _run_plot(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """tools/plot_metrics.py in this process (its exit code and output, as a process of its own gives)."""
    return in_process(str(PLOT), *args, env=clean_env(MPLCONFIGDIR=str(tmp_path / "mpl")))


def _assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 1024, f"{path} is suspiciously small ({len(data)} bytes)"


def test_plot_metrics_two_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_a = _write_run(tmp_path / "run_a", epochs=6, with_ema=False)
    run_b = _write_run(tmp_path / "run_b", epochs=4, with_ema=True)
    out = tmp_path / "both.png"
    proc = _run_plot(str(run_a), str(run_b), "-o", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _assert_png(out)


def test_plot_metrics_single_run_default_output(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _write_run(tmp_path / "only", epochs=3, with_ema=True)
    proc = _run_plot(str(run), "--labels", "only run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _assert_png(run / "metrics.png")


def test_every_curve_of_a_one_epoch_run_is_drawn_visibly(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from distribuuuu.records.plots import load_run, make_figure

    records = [
        _record(1, "train", 2.0, lr=0.1),
        _record(1, "val", 1.8, weights="model"),
        _record(1, "val", 1.6, weights="ema"),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(str(tmp_path), None)
    lines = [line for ax in make_figure(plt, [run]).axes for line in ax.get_lines()]
    assert len(lines) == 7  # train and val loss; train, val and EMA top-1; lr; images/s
    assert all(len(line.get_xdata()) == 1 and line.get_marker() not in (None, "", "None") for line in lines)
    plt.close("all")


def test_the_summary_of_an_evaluation_folder_gives_its_test_records_and_draws_no_empty_plot(tmp_path: Path) -> None:
    from distribuuuu.records.summary import write_summary

    tested = [_record(3, "test", 0.5, weights="model"), _record(3, "test", 0.4, weights="ema")]  # as test_net.py writes
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tested))
    text = write_summary(str(tmp_path))
    for r in tested:
        said = f"- test (test_net.py) top-1 ({r['weights']}): {r['top1']:.2f}% (top-5 {r['topk']:.2f}%, epoch 3)"
        assert said in text, text
    assert "- plot: none (no training or validation records to draw)" in text
    assert not (tmp_path / "metrics.png").exists()


MULTILABEL = {"top1": 40.0, "map": 91.25, "f1_macro": 80.5}


@pytest.mark.parametrize(
    "metric, record, said",
    [
        ("top1", {"top1": 97.5}, "- best val top-1: 97.50% (ema weights, epoch 3)"),
        ("loss", {"top1": 97.5, "loss": 0.125}, "- best val loss (TRAIN.BEST_METRIC loss): 0.1250 (top-1 97.50%, ema weights, epoch 3)"),
        ("map", MULTILABEL, "- best val mAP (TRAIN.BEST_METRIC map): 91.25% (F1 macro 80.50%, ema weights, epoch 3)"),
        ("f1_macro", MULTILABEL, "- best val F1 macro (TRAIN.BEST_METRIC f1_macro): 80.50% (mAP 91.25%, ema weights, epoch 3)"),
        ("loss", {**MULTILABEL, "loss": 0.125}, "- best val loss (TRAIN.BEST_METRIC loss): 0.1250 (mAP 91.25%, F1 macro 80.50%, ema weights, epoch 3)"),
        ("top1", MULTILABEL, "- best val top-1 (TRAIN.BEST_METRIC top1): 40.00% (mAP 91.25%, F1 macro 80.50%, ema weights, epoch 3)"),
    ],
)  # fmt: skip
def test_the_best_line_gives_the_best_metric_beside_the_runs_headline_metrics(metric, record, said):
    from distribuuuu.records.summary import Summary, format_summary

    summary = Summary(out_dir="run", best={**record, "weights": "ema", "epoch": 3}, best_metric=metric)
    assert said in format_summary(summary).splitlines()


def _multilabel_run(folder: Path, epochs: int, best: str = "map") -> None:
    """metrics.jsonl of a multi-label run: train records with precision at 1, val records (raw and
    EMA) with mAP and F1, the best by ``best`` marked as the trainer marks it."""
    records = []
    for epoch in range(1, epochs + 1):
        records.append(_record(epoch, "train", 1.0 / epoch, lr=0.1))
        for weights, gain in (("model", 0.0), ("ema", 2.0)):
            scores = {"map": 50.0 + 10 * epoch + gain, "f1_macro": 30.0 + 10 * epoch + gain}
            records.append(_record(epoch, "val", 0.5 / epoch, weights=weights, **scores))
    records[-1]["best"] = best  # the last epoch's EMA evaluation
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _figure(folder: Path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from distribuuuu.records.plots import load_run, make_figure

    return plt, make_figure(plt, [load_run(str(folder), "r")])


def test_a_multilabel_runs_plot_draws_val_map_and_f1_and_marks_the_best(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _multilabel_run(tmp_path, epochs=3)
    plt, fig = _figure(tmp_path)
    metric_axis = fig.axes[1]
    assert "mAP" in metric_axis.get_title() and "F1" in metric_axis.get_title()
    drawn = {line.get_label(): list(line.get_ydata()) for line in metric_axis.get_lines()}
    assert drawn == {
        "r val mAP": [60.0, 70.0, 80.0],
        "r val (ema) mAP": [62.0, 72.0, 82.0],
        "r val F1 macro": [40.0, 50.0, 60.0],
        "r val (ema) F1 macro": [42.0, 52.0, 62.0],
        "r best (mAP, ema weights)": [82.0],
    }  # and no top-1: a multi-label run's top-1 is precision at 1
    plt.close("all")


@pytest.mark.parametrize("epochs", [1, 2, 3])
def test_every_axis_ticks_whole_epochs(tmp_path: Path, epochs: int) -> None:
    pytest.importorskip("matplotlib")
    _multilabel_run(tmp_path, epochs=epochs)
    plt, fig = _figure(tmp_path)
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.xaxis.get_major_locator()() if low <= t <= high]
        assert ticks and all(t == int(t) for t in ticks), (ax.get_title(), ticks)
    plt.close("all")


def test_plot_metrics_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_run"
    proc = _run_plot(str(missing), "-o", str(tmp_path / "x.png"), tmp_path=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(missing / "metrics.jsonl") in lines[0]
    assert not (tmp_path / "x.png").exists()


def test_the_star_marks_the_last_best_written_across_the_raw_and_the_ema_weights(tmp_path: Path) -> None:
    """The EMA's evaluation best at epoch 1, the raw weights' at epoch 2: the run's best is epoch 2's
    raw weights (best.pth.tar's), whichever list of records the plot reads first."""
    pytest.importorskip("matplotlib")
    records = []
    for epoch, (raw, ema) in enumerate(((90.0, 95.0), (99.0, 96.0)), start=1):
        records.append(_record(epoch, "train", 1.0 / epoch, lr=0.1))
        records.append(
            _record(epoch, "val", 0.5, weights="model", top1=raw, **({"best": "top1"} if epoch == 2 else {}))
        )
        records.append(_record(epoch, "val", 0.5, weights="ema", top1=ema, **({"best": "top1"} if epoch == 1 else {})))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plt, fig = _figure(tmp_path)
    stars = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[1].get_lines()}
    assert stars["r best (top-1, model weights)"] == ([2.0], [99.0]), stars
    plt.close("all")
