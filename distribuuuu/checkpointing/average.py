"""Checkpoint averaging (tools/avg_checkpoints.py): the last N or the best N checkpoints of an OUT_DIR,
raw or EMA weights, averaged into one checkpoint that every tool takes like any other.

Floating-point tensors are averaged element-wise (summed in float64, rounded once to their
dtype); integer ones (BatchNorm's ``num_batches_tracked``) are the newest input's. BatchNorm's
running means and variances are averaged too: the mean of running means is the running mean over
the union of the inputs' statistics only approximately, and they were taken for other weights
than the average; recomputing them for the averaged weights (precise BN, ``--precise-bn``) is the
exact answer.
"""

from __future__ import annotations

import os

from distribuuuu.checkpointing.checkpoint import load_checkpoint
from distribuuuu.checkpointing.names import CKPT_DIR, FILE, checkpoint_position, list_checkpoints
from distribuuuu.checkpointing.single_file import model_state_from
from distribuuuu.errors import CheckpointError
from distribuuuu.records.metrics_file import METRICS_FILE, MetricsError, read_records

# What the averaged checkpoint keeps of the newest input: what a best.pth.tar holds (the tools read
# these), less the optimizer, scaler, RNG and position, which belong to no averaged weights.
KEPT = ("epoch", "best_acc1", "classes", "arch", "cfg", "preprocessing")
_EPOCH_END = 1 << 62  # checkpoint_position's step of an epoch-end checkpoint


def checkpoints_by_position(out_dir: str) -> dict[tuple[int, int], str]:
    """OUT_DIR/checkpoints' checkpoints by (epoch, step), oldest first; the single file where a
    position has both formats (a run that changed format). A CheckpointError when there is none."""
    ckpt_dir = os.path.join(out_dir, CKPT_DIR)
    found: dict[tuple[int, int], str] = {}
    for path in list_checkpoints(ckpt_dir, "any"):
        position = checkpoint_position(path)
        if position not in found or path.endswith(FILE):
            found[position] = path
    if not found:
        raise CheckpointError(f"no checkpoints in {ckpt_dir}")
    return dict(sorted(found.items()))


def last_checkpoints(out_dir: str, n: int) -> list[str]:
    """The newest ``n`` checkpoints of OUT_DIR (epoch-end and mid-epoch ones), oldest first."""
    found = list(checkpoints_by_position(out_dir).values())
    if n > len(found):
        raise CheckpointError(f"--last {n}: {os.path.join(out_dir, CKPT_DIR)} holds only {len(found)} checkpoint(s)")
    return found[-n:]


def best_checkpoints(
    out_dir: str, n: int, metric: str, split: str = "val", weights: str = "model", lower_is_better: bool | None = None
) -> list[tuple[str, float]]:
    """The ``n`` epoch-end checkpoints still in OUT_DIR whose epoch's ``split`` record of ``weights``
    scores best by ``metric`` (of OUT_DIR/metrics.jsonl; lower is better for a loss unless told),
    oldest first, each with its score. A later record of an epoch (a resumed run) replaces an earlier."""
    path = os.path.join(out_dir, METRICS_FILE)
    try:
        records = read_records(path)
    except MetricsError as e:
        raise CheckpointError(str(e)) from None
    rows = [r for r in records if r.get("split") == split and r.get("weights", "model") == weights]
    if not rows:
        why = " (a run without EMA weights, OPTIM.EMA_DECAY 0, or none evaluated yet)" if weights == "ema" else ""
        raise CheckpointError(f"{path} has no {split} record of the {weights} weights{why}")
    scored = [r for r in rows if isinstance(r.get(metric), (int, float))]
    if not scored:
        known = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "epoch"})
        raise CheckpointError(
            f"--metric {metric}: no {split} record of the {weights} weights in {path} has it (they have: "
            f"{', '.join(known)})"
        )
    by_epoch = {int(r["epoch"]): float(r[metric]) for r in scored}
    found = checkpoints_by_position(out_dir)
    available = [(found[(e, _EPOCH_END)], v) for e, v in by_epoch.items() if (e, _EPOCH_END) in found]
    if n > len(available):
        raise CheckpointError(
            f"--best {n}: only {len(available)} epoch-end checkpoint(s) in {os.path.join(out_dir, CKPT_DIR)} "
            f"have a {split} {metric} record (TRAIN.KEEP_CKPTS prunes older ones)"
        )
    lower = "loss" in metric if lower_is_better is None else lower_is_better
    # Best first; between equal scores the newer checkpoint.
    ranked = sorted(available, key=lambda pv: (pv[1] if lower else -pv[1], -checkpoint_position(pv[0])[0]))[:n]
    return sorted(ranked, key=lambda pv: checkpoint_position(pv[0]))


def average_weights(weights: list[dict], names: list[str]) -> dict:
    """The element-wise mean of state dicts of one architecture (``names``: where each came from,
    for the errors); integer tensors are the last one's (the newest)."""
    first, last = weights[0], weights[-1]
    sums = {k: v.double().clone() for k, v in first.items() if v.is_floating_point()}
    for w, name in zip(weights[1:], names[1:]):
        if w.keys() != first.keys():
            differ = sorted(set(w.keys()) ^ set(first.keys()))[:3]
            raise CheckpointError(f"{name} holds other tensors than {names[0]} (e.g. {', '.join(differ)})")
        for k, total in sums.items():
            if w[k].shape != total.shape:
                raise CheckpointError(f"{name}: {k} has shape {tuple(w[k].shape)}, {names[0]} {tuple(total.shape)}")
            total += w[k].double()
    averaged = type(first)()  # an OrderedDict keeps the state_dict's order
    for k, v in last.items():
        averaged[k] = (sums[k] / len(weights)).to(v.dtype) if k in sums else v.clone()
    if hasattr(last, "_metadata"):
        averaged._metadata = last._metadata
    return averaged


def averaged_checkpoint(paths: list[str], kind: str = "model", how: str = "") -> dict:
    """The checkpoint of the mean of ``paths``' ``kind`` weights ("model" or "ema"), as its raw
    weights, with the newest input's (the last's) classes, architecture, config and preprocessing."""
    weights = []
    newest: dict = {}
    for path in paths:
        newest = load_checkpoint(path)
        try:
            weights.append(model_state_from(newest, kind))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    state = {k: newest[k] for k in KEPT if k in newest}
    state.update(
        model=average_weights(weights, paths),
        ema=None,
        best_weights="model",
        averaged={"checkpoints": [os.path.basename(os.path.normpath(p)) for p in paths], "weights": kind, "how": how},
    )
    return state


def check_output(path: str) -> None:
    """Refuse to overwrite, and refuse a checkpoint's name (a run would resume from the average)."""
    if os.path.exists(path):
        raise CheckpointError(f"{path} exists: refusing to overwrite it")
    if checkpoint_position(path) is not None:
        raise CheckpointError(
            f"{path}: a training checkpoint's name (a run would resume from it); name it otherwise, e.g. avg.pth.tar"
        )
