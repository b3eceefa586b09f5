"""Multi-label classification: mAP, F1, precision and recall identical for 1, 2 and 3 ranks and equal
to an independent computation of scikit-learn's definitions; the loss and the mixing of multi-hot
targets against their closed forms."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import EVAL_TINY, REPO, TEST, TINY_TRAIN, assert_ok, in_process, on_ranks, read_metrics
from torch.nn import functional as F

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint, model_state_from
from distribuuuu.config import ConfigError, get_cfg_defaults, load_cfg
from distribuuuu.data import load_image
from distribuuuu.data.samplers import ExactEvalSampler
from distribuuuu.losses import MultiLabelBCE
from distribuuuu.records.multilabel import MultiLabelSums
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.preprocessing import build_batch_mixer, build_val_transform

# In-process runs on one thread: they run beside the background jobs (tests/background.py).
pytestmark = pytest.mark.usefixtures("plain_logging")

N, C, BINS, THRESHOLD = 257, 6, 64, 0.4
PAIRS, PREDICT, EXPORT = (str(REPO / "tools" / t) for t in ("make_digit_pairs.py", "predict.py", "export.py"))


def _predictions() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with ties, a class with far-out extremes and a class without positives; multi-hot targets."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, C, generator=g) * 4
    logits[::7] = logits[1::7][: len(logits[::7])]  # tied rows
    logits[:5, 0] = torch.tensor([30.0, -30.0, 16.0, -16.0, 0.0])
    targets = (torch.rand(N, C, generator=g) < torch.linspace(0.05, 0.6, C)).float()
    targets[:, 3] = 0.0  # no positives: left out of mAP, F1 0 unless predicted
    return logits, targets


def _sklearn_average_precision(scores: np.ndarray, y: np.ndarray) -> float:
    """scikit-learn's average_precision_score, re-derived: precision at each distinct score,
    highest first, times the recall gained there."""
    order = np.argsort(-scores, kind="mergesort")
    scores, y = scores[order], y[order]
    last_of_each_score = np.r_[np.nonzero(np.diff(scores))[0], len(y) - 1]
    tps = np.cumsum(y)[last_of_each_score]
    precision = tps / (last_of_each_score + 1)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def _levels(logits: torch.Tensor, bins: int) -> np.ndarray:
    """The documented quantisation, in numpy: ``bins`` levels evenly over each class's observed range."""
    x = logits.double().numpy()
    low, span = x.min(axis=0), x.max(axis=0) - x.min(axis=0)
    scale = np.divide(bins, span, out=np.zeros_like(span), where=span > 0)
    return np.clip(np.floor((x - low) * scale), 0, bins - 1)


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    levels = _levels(logits, BINS)
    y = targets.numpy() > 0.5
    aps = [_sklearn_average_precision(levels[:, c].astype(float), y[:, c]) for c in range(C) if y[:, c].any()]
    pred = torch.sigmoid(logits).numpy() >= THRESHOLD
    tp, fp, fn = ((pred & y).sum(0), (pred & ~y).sum(0), (~pred & y).sum(0))
    f1 = [2 * a / (2 * a + b + c) if a + b + c else 0.0 for a, b, c in zip(tp, fp, fn)]
    return {
        "map": 100 * np.mean(aps),
        "f1_macro": 100 * np.mean(f1),
        "f1_micro": 100 * 2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()),
        "precision_macro": 100 * np.mean([a / (a + b) if a + b else 0.0 for a, b in zip(tp, fp)]),
        "precision_micro": 100 * tp.sum() / (tp.sum() + fp.sum()),
        "recall_macro": 100 * np.mean([a / (a + c) if a + c else 0.0 for a, c in zip(tp, fn)]),
        "recall_micro": 100 * tp.sum() / (tp.sum() + fn.sum()),
    }


def test_multilabel_metrics_are_identical_for_1_2_3_ranks_and_equal_scikit_learns_definitions():
    logits, targets = _predictions()
    per_world = [_logged_on_ranks(logits, targets, w, BINS, THRESHOLD, batch=10) for w in (1, 2, 3)]
    assert per_world[0] == per_world[1] == per_world[2]  # to the last digit
    # Float64 sums of at most N terms in another order: agreement to ~N ulps of a value <= 100.
    expected = _reference(logits, targets)
    assert per_world[0] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # One process with no group: reduce() is the sum of nothing else.
    sums = MultiLabelSums(C, BINS, THRESHOLD, torch.device("cpu"))
    sums.add(logits, targets)
    assert sums.reduce() == per_world[0]


def test_multilabel_metrics_equal_scikit_learns_on_the_gathered_predictions():
    metrics = _sklearn_metrics()
    logits, targets = _predictions()
    ours = _logged_on_ranks(logits, targets, 3, BINS, THRESHOLD, batch=10)
    levels, y = _levels(logits, BINS), targets.numpy().astype(int)
    with_positives = [c for c in range(C) if y[:, c].any()]  # AP is undefined without a positive
    ap = [metrics.average_precision_score(y[:, c], levels[:, c]) for c in with_positives]
    pred = (torch.sigmoid(logits) >= THRESHOLD).numpy().astype(int)
    expected = {"map": 100 * np.mean(ap)}
    for name, score in (
        ("f1", metrics.f1_score),
        ("precision", metrics.precision_score),
        ("recall", metrics.recall_score),
    ):
        for average in ("macro", "micro"):
            expected[f"{name}_{average}"] = 100 * score(y, pred, average=average, zero_division=0)
    assert {k: ours[k] for k in expected} == pytest.approx(expected, rel=1e-12, abs=1e-12)


def _sklearn_metrics():
    """sklearn.metrics, imported with the environment put back as it was."""
    before = dict(os.environ)
    metrics = pytest.importorskip("sklearn.metrics")
    # scikit-learn sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK on import: OpenMP start-up variables,
    # which would make every later launch of the suite differ from the fork server's (all run fresh).
    os.environ.clear()
    os.environ.update(before)
    return metrics


def _logged_on_ranks(
    logits: torch.Tensor, targets: torch.Tensor, world_size: int, bins: int, threshold: float = 0.5, batch: int = 64
) -> dict[str, float]:
    """The metrics ``validate`` logs: each rank of a real (threaded) process group adds its
    ExactEvalSampler shard a batch at a time, then ``reduce`` on every rank; every rank's figures."""

    def rank_metrics(rank: int) -> dict[str, float]:
        sums = MultiLabelSums(logits.shape[1], bins, threshold, torch.device("cpu"))
        mine = list(ExactEvalSampler(len(logits), world_size, rank))
        for start in range(0, len(mine), batch):
            sums.add(logits[mine[start : start + batch]], targets[mine[start : start + batch]])
        return sums.reduce()

    per_rank = on_ranks(world_size, rank_metrics)
    assert all(r == per_rank[0] for r in per_rank)
    return per_rank[0]


@pytest.mark.parametrize("stage", ["undertrained", "trained"])
def test_logged_map_is_scikit_learns_average_precision_within_a_tenth_of_a_point_on_1_2_3_ranks(stage):
    # Early in training every logit of a class lies within a tenth of a logit of the others (a
    # fresh head): the levels must resolve them as scikit-learn ranks them, and still do once
    # training has spread them over tens of logits.
    metrics = _sklearn_metrics()
    g = torch.Generator().manual_seed(1)
    n, c = 6000, 8
    targets = (torch.rand(n, c, generator=g) < torch.linspace(0.05, 0.5, c)).float()
    noise, base = torch.randn(n, c, generator=g), torch.randn(c, generator=g) - 2
    if stage == "undertrained":  # a faint signal in a narrow spread
        logits = base + 0.01 * noise + 0.006 * targets
        assert (logits.amax(0) - logits.amin(0)).max() < 0.1
    else:
        logits = 6 * targets - 3 + 2 * noise
    y = targets.numpy().astype(int)
    expected = 100 * np.mean([metrics.average_precision_score(y[:, k], logits[:, k].numpy()) for k in range(c)])
    bins = get_cfg_defaults().TEST.AP_BINS  # what a run logs
    per_world = [_logged_on_ranks(logits, targets, w, bins) for w in (1, 2, 3)]
    assert per_world[0] == per_world[1] == per_world[2]  # to the last digit
    assert per_world[0]["map"] == pytest.approx(expected, abs=0.1)


def _held_bytes(obj) -> int:
    """Bytes of every tensor an object holds in its attributes (directly or in lists)."""
    items = [v for value in vars(obj).values() for v in (value if isinstance(value, (list, tuple)) else [value])]
    return sum(t.nbytes for t in items if isinstance(t, torch.Tensor))


def test_each_rank_holds_its_own_share_of_the_scores_and_nothing_that_grows_with_the_val_set():
    # Stored on a rank until reduce(): its samples' fp32 logits (4 bytes) and positives (1 byte, bool)
    # for each class, and each class's lowest and highest logit (2 x 4 bytes): never another rank's.
    def held(n: int, world_size: int) -> list[int]:
        logits, targets = torch.randn(n, C), (torch.rand(n, C) < 0.3).float()

        def rank_bytes(rank: int) -> int:
            sums = MultiLabelSums(C, 4096, 0.5, torch.device("cpu"))
            mine = list(ExactEvalSampler(n, world_size, rank))
            for start in range(0, len(mine), 32):
                sums.add(logits[mine[start : start + 32]], targets[mine[start : start + 32]])
            return _held_bytes(sums)

        return on_ranks(world_size, rank_bytes)

    for n, world_size in ((100, 1), (1000, 2), (1001, 3)):
        shares = [len(ExactEvalSampler(n, world_size, r)) for r in range(world_size)]
        assert held(n, world_size) == [share * C * 5 + 2 * C * 4 for share in shares]


def test_negative_images_all_zero_target_rows_count_as_negatives_in_every_metric():
    # An annotation line with an empty label field (docs/annotations.md) is such a row: it adds false
    # positives where a class is predicted, and to each class's ranking, as scikit-learn counts it.
    logits, targets = _predictions()
    targets[::3] = 0.0
    sums = MultiLabelSums(C, BINS, THRESHOLD, torch.device("cpu"))
    sums.add(logits, targets)
    negatives_only = MultiLabelSums(C, BINS, THRESHOLD, torch.device("cpu"))
    negatives_only.add(logits[::3], targets[::3])
    assert sums.reduce() == pytest.approx(_reference(logits, targets), rel=1e-12, abs=1e-12)
    assert negatives_only.reduce()["map"] == 0.0 and negatives_only.reduce()["f1_micro"] == 0.0


def test_average_precision_of_untied_scores_is_the_exact_ap_once_levels_separate_them():
    scores = torch.tensor([[2.0], [1.0], [0.5], [-1.0], [-3.0]])
    y = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0]])
    sums = MultiLabelSums(1, 4096, 0.5, torch.device("cpu"))
    sums.add(scores, y)
    # Ranked 1 0 1 1 0: precision 1/1, 2/3, 3/4 at the positives.
    assert sums.reduce()["map"] == pytest.approx(100 * (1 + 2 / 3 + 3 / 4) / 3, rel=1e-15)


def test_non_finite_logits_rank_at_the_ends_and_leave_the_others_counted():
    # NaN ranks lowest and +inf highest (a fp16 overflow): the range stays finite, nothing raises.
    logits = torch.tensor([[float("inf")], [1.0], [0.5], [float("nan")]])
    y = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    sums = MultiLabelSums(1, 4096, 0.5, torch.device("cpu"))
    sums.add(logits, y)
    # Ranked 1 0 1 0: precision 1/1 and 2/3 at the positives.
    assert sums.reduce()["map"] == pytest.approx(100 * (1 + 2 / 3) / 2, rel=1e-15)


@pytest.mark.parametrize("threshold", ["0", "1", "0.0", "1.0"])
def test_any_threshold_in_0_1_is_accepted_its_ends_included(threshold):
    # 0: every class predicted (every score is at least 0); 1: only scores that round to 1.
    assert load_cfg(None, ["MODEL.TASK", "multilabel", "TEST.THRESHOLD", threshold]).TEST.THRESHOLD == float(threshold)


@pytest.mark.parametrize("threshold", ["-0.01", "1.01"])
def test_a_threshold_outside_0_1_is_refused_naming_the_key(threshold):
    with pytest.raises(ConfigError, match=rf"^TEST\.THRESHOLD must be in \[0, 1\], got {threshold}$"):
        load_cfg(None, ["MODEL.TASK", "multilabel", "TEST.THRESHOLD", threshold])


def test_multilabel_bce_is_the_closed_form_with_smoothing_and_positive_weights():
    logits, targets = _predictions()
    pos_weight = torch.linspace(0.5, 3.0, C)
    got = MultiLabelBCE(smoothing=0.1, pos_weight=pos_weight)(logits, targets)
    t = targets * 0.9 + 0.05
    p = torch.sigmoid(logits.double())
    expected = -(pos_weight.double() * t * torch.log(p) + (1 - t) * torch.log1p(-p)).mean()
    assert got.double().item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.equal(MultiLabelBCE()(logits, targets), F.binary_cross_entropy_with_logits(logits, targets))


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_mixup_and_cutmix_mix_multi_hot_targets_by_each_samples_share_of_the_pixels(mix):
    key = "DATA.MIXUP_ALPHA" if mix == "mixup" else "DATA.CUTMIX_ALPHA"
    cfg = load_cfg(None, ["MODEL.TASK", "multilabel", key, "1.0", "TRAIN.BATCH_SIZE", "8"])
    mixer = build_batch_mixer(cfg)
    n = 6  # fewer than TRAIN.BATCH_SIZE: a batch with skipped images
    images = torch.arange(1.0, n + 1).view(n, 1, 1, 1).expand(n, 3, 16, 16).contiguous()
    targets = (torch.rand(n, 10, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    torch.manual_seed(3)
    mixed, soft = mixer(images, targets)
    for i in range(n):
        j = (i - 1) % n  # torchvision mixes each sample with the one before it
        # Image i is all i+1, image j all j+1: the mean pixel gives i's share lam.
        lam = (mixed[i].mean() - (j + 1)) / ((i + 1) - (j + 1))
        assert torch.allclose(soft[i], lam * targets[i] + (1 - lam) * targets[j], atol=1e-6)


# ------------------------------------------------------------------------------------------------
# A multi-label run of two-digit images (tools/make_digit_pairs.py), and the tools on its checkpoint
# ------------------------------------------------------------------------------------------------
PAIRS_RUN = [
    *EVAL_TINY, "MODEL.TASK", "multilabel", "TRAIN.ANN_FILE", "train.csv",
    "TEST.ANN_FILE", "val.csv", "DATA.ANN_HEADER", "True", "DATA.MIXUP_ALPHA", "0.2", "TRAIN.LABEL_SMOOTHING", "0.1",
    "TRAIN.CLASS_WEIGHTS", "balanced", "OPTIM.EMA_DECAY", "0.9", "TRAIN.BEST_METRIC", "map", "OPTIM.MAX_EPOCH", "2",
    "TRAIN.BATCH_SIZE", "16", "TRAIN.CKPT_PERIOD_ITERS", "4", "TRAIN.KEEP_CKPTS", "100", "OPTIM.BASE_LR", "0.2",
]  # fmt: skip


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two epochs of the tiny CNN on 160 two-digit images (mixup, smoothing, positive weights, EMA,
    best by mAP), checkpointing every 4 steps: (its OUT_DIR, its options)."""
    root = tmp_path_factory.mktemp("pairs")
    assert_ok(in_process(PAIRS, str(root / "data"), "--train", "160", "--val", "48"))
    opts = [*PAIRS_RUN, "TRAIN.DATASET", str(root / "data"), "TEST.DATASET", str(root / "data")]
    assert_ok(in_process(TINY_TRAIN, *opts, "OUT_DIR", str(root / "out")))
    return root / "out", opts


def test_a_multilabel_run_records_map_and_f1_and_keeps_the_best_by_map(pairs_run):
    out, _ = pairs_run
    vals = [r for r in read_metrics(out) if r.get("split") == "val"]
    assert {r["weights"] for r in vals} == {"model", "ema"} and all(0 <= r["map"] <= 100 for r in vals)
    best = max(vals, key=lambda r: r["map"])
    state = load_checkpoint(str(out / ckpt.BEST_NAME))
    assert (state["best_metric"], state["best_value"], state["best_weights"]) == ("map", best["map"], best["weights"])
    summary = (out / "summary.md").read_text()
    said = f"best val mAP (TRAIN.BEST_METRIC map): {best['map']:.2f}% (F1 macro {best['f1_macro']:.2f}%, {best['weights']} weights, epoch"
    assert said in summary, summary
    last = {r["weights"]: r for r in vals}  # the last epoch's record of each weights kind
    for weights, r in last.items():
        said = f"last val mAP ({weights}): {r['map']:.2f}% (F1 macro {r['f1_macro']:.2f}%, micro {r['f1_micro']:.2f}%"
        assert said in summary, summary
    assert "last val top-1" not in summary, summary


def _val_images(opts: list[str], count: int) -> list[str]:
    data = Path(opts[opts.index("TRAIN.DATASET") + 1])
    return sorted(str(p) for p in (data / "val").glob("*.png"))[:count]


def _sigmoid_scores(weights: str, images: list[str]) -> tuple[torch.Tensor, list[str]]:
    """The checkpoint's model's sigmoid scores of ``images``, computed here (independently of
    predict.py), and its class names."""
    state = load_checkpoint(weights)
    cfg = load_cfg(None, [*EVAL_TINY, "MODEL.TASK", "multilabel"])
    model = build_configured_model(cfg.MODEL).eval()
    model.load_state_dict(model_state_from(state))
    transform = build_val_transform(cfg)
    with torch.no_grad():
        return torch.sigmoid(model(torch.stack([transform(load_image(p)) for p in images]))), state["classes"]


def test_test_net_and_predict_agree_with_the_training_run_on_a_multilabel_checkpoint(pairs_run, tmp_path):
    out, opts = pairs_run
    weights = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(2))
    assert_ok(in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", str(tmp_path / "eval")))
    [tested] = [r for r in read_metrics(tmp_path / "eval") if r["split"] == "test"]
    [last] = [r for r in read_metrics(out) if r.get("split") == "val" and r["weights"] == "model" and r["epoch"] == 2]
    assert all(tested[f] == last[f] for f in ("map", "f1_macro", "f1_micro", "precision_micro", "recall_macro"))
    # predict.py's classes above the threshold are the model's sigmoid scores >= TEST.THRESHOLD.
    images = _val_images(opts, 8)
    result = in_process(PREDICT, "--weights", weights, "--json", *images)
    assert_ok(result)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    scores, classes = _sigmoid_scores(weights, images)
    for line, row in zip(lines, scores):
        expected = {classes[c]: row[c].item() for c in range(10) if row[c] >= 0.5}
        assert {x["class"]: x["prob"] for x in line["labels"]} == pytest.approx(expected, abs=1e-6)


def test_predict_gives_every_classs_score_and_the_topk_of_a_multilabel_checkpoint(pairs_run):
    out, opts = pairs_run
    weights, images = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)), _val_images(opts, 6)
    scores, classes = _sigmoid_scores(weights, images)
    as_json = in_process(PREDICT, "--weights", weights, "--json", "--topk", "2", *images)
    assert_ok(as_json)
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [line["path"] for line in lines] == images
    for line, row in zip(lines, scores):
        # Every class's sigmoid score, by name; the two best by score; those at the threshold.
        assert line["scores"] == pytest.approx({name: row[c].item() for c, name in enumerate(classes)}, abs=1e-6)
        best = row.argsort(descending=True)[:2].tolist()
        assert [x["class"] for x in line["topk"]] == [classes[c] for c in best]
        assert line["threshold"] == 0.5
    as_text = in_process(PREDICT, "--weights", weights, "--topk", "3", *images)
    assert_ok(as_text)
    for text, row in zip(as_text.stdout.splitlines(), scores):
        listed = re.findall(r"(\S+) \((\d\.\d{3})\)(\*?)", text.split(": ", 1)[1])
        best = row.argsort(descending=True)[:3].tolist()
        assert [name for name, _, _ in listed] == [classes[c] for c in best], text
        assert [mark == "*" for _, _, mark in listed] == [bool(row[c] >= 0.5) for c in best], text


def test_predict_takes_threshold_0_every_class_predicted(pairs_run):
    out, opts = pairs_run
    weights, images = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)), _val_images(opts, 2)
    result = in_process(PREDICT, "--weights", weights, "--json", *images, "TEST.THRESHOLD", "0")
    assert_ok(result)
    for line in map(json.loads, result.stdout.splitlines()):
        assert line["threshold"] == 0.0 and {x["class"] for x in line["labels"]} == set(line["scores"])


def test_export_records_a_multilabel_checkpoints_task_and_threshold(pairs_run, tmp_path):
    for module in ("onnx", "onnxruntime", "onnxscript"):  # the "export" extra
        pytest.importorskip(module)
    out, _ = pairs_run
    weights = str(out / ckpt.CKPT_DIR / ckpt.checkpoint_name(2))
    assert_ok(in_process(EXPORT, "--weights", weights, "--out", str(tmp_path / "m"), "--max-check", "8"))
    meta = json.loads((tmp_path / "m.json").read_text())
    assert (meta["task"], meta["threshold"]) == ("multilabel", 0.5)


@pytest.mark.slow
def test_a_mid_epoch_resume_of_a_multilabel_run_is_bit_identical(pairs_run, tmp_path):
    out, opts = pairs_run
    resumed = tmp_path / "resumed"
    (resumed / ckpt.CKPT_DIR).mkdir(parents=True)
    mid = ckpt.checkpoint_name(2, 4)  # 4 steps into epoch 2
    shutil.copy(out / ckpt.CKPT_DIR / mid, resumed / ckpt.CKPT_DIR / mid)
    assert_ok(in_process(TINY_TRAIN, *opts, "OUT_DIR", str(resumed)))
    end = [load_checkpoint(str(d / ckpt.CKPT_DIR / ckpt.checkpoint_name(2))) for d in (out, resumed)]
    for key in ("model", "ema", "optimizer"):
        assert torch.equal(
            torch.cat([t.flatten() for t in _tensors(end[0][key])]),
            torch.cat([t.flatten() for t in _tensors(end[1][key])]),
        )
    last = [[r for r in read_metrics(d) if r.get("split") == "val" and r["epoch"] == 2] for d in (out, resumed)]
    assert [r["map"] for r in last[0]] == [r["map"] for r in last[1]]


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree.float()]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_pack_tool_packs_multi_label_annotations_with_every_class_of_each_sample(pairs_run, tmp_path):
    from distribuuuu.data.annotations import AnnotationSpec, read_annotations
    from distribuuuu.data.packed import PackedDataset

    pytest.importorskip("webdataset")
    _, opts = pairs_run
    data = Path(opts[opts.index("TRAIN.DATASET") + 1])
    args = [str(data), str(tmp_path / "packed"), "--splits", "val", "--ann-files", "val.csv", "--ann-header"]
    assert_ok(in_process(str(REPO / "tools" / "pack_dataset.py"), *args, "--label-sep", " "))
    listed, classes = read_annotations(str(data), AnnotationSpec("val.csv", True, label_sep=" "))
    packed = PackedDataset(str(tmp_path / "packed"), "val")
    assert packed.classes == classes and any(len(t) == 2 for _, t in listed)
    assert dict(packed.samples) == {os.path.relpath(p, data): t for p, t in listed}
