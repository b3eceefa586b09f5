"""One epoch's numbers -> the log line, metrics.jsonl, TensorBoard and the trackers (takes values, not a Run).

The metrics writer owns the records: it appends them, plots them, hands them to the trackers and,
at the end of training, writes the run summary.
"""

from __future__ import annotations

import json
import os

from distribuuuu.logger import SAME_ON_EVERY_RANK, get_logger
from distribuuuu.progress import WINDOW
from distribuuuu.records.metrics_file import METRICS_FILE, MetricsError, repair_torn_tail
from distribuuuu.records.multilabel import FIELDS as MULTILABEL_FIELDS
from distribuuuu.records.telemetry import EPOCH_FIELDS as TELEMETRY_FIELDS
from distribuuuu.records.telemetry import WindowTelemetry
from distribuuuu.records.tracking import TrackerSettings

logger = get_logger("trainer")  # the training log's own name: its lines read as the trainer's


def log_train_window(
    writer, totals: dict, epoch: int, step: int, max_epoch: int, k: int | None, last_step: int, *, lr: float,
    elapsed_s: float, data_s: float, steps: int, steps_left: int, fp16: bool, global_step: int,
    telemetry: WindowTelemetry | None = None,
) -> None:  # fmt: skip
    """Log one PRINT_FREQ window of training (loss, accuracy, LR, speed, data wait, ETA; ``telemetry``:
    the ranks' step times, the data share, TFLOP/s and MFU) and plot it.

    Only host values of the sync point: the reduced ``totals`` and the host clock. The log record
    carries the window's numbers for the terminal's progress bar (progress.py). ``last_step``: the
    step the epoch ends at (``step``/``last_step`` in the line); ``k``: the top-k reported (None: none).
    """
    eta_s = elapsed_s / max(steps, 1) * steps_left
    images_per_s = totals["samples"] / max(elapsed_s, 1e-9)
    skipped = int(totals["skipped_steps"])
    what = "fp16 overflow steps skipped" if fp16 else "non-finite steps skipped"
    bar = {
        "epoch": epoch + 1, "max_epoch": max_epoch, "step": step, "last_step": last_step,
        "loss": totals["loss"], "images_per_s": images_per_s, "eta": hms(eta_s),
    }  # fmt: skip
    logger.info(
        "epoch %d/%d  step %d/%d  loss %.4f  top1 %.2f%s  lr %.5g  %.0f img/s  data %.3fs/step%s  eta %s%s",
        epoch + 1, max_epoch, step, last_step, totals["loss"], totals["top1_acc"],
        topk_text(k, totals["topk_acc"]), lr, images_per_s, data_s / max(steps, 1),
        telemetry.text() if telemetry else "", hms(eta_s), f"  {what} {skipped}" if skipped else "", extra={WINDOW: bar},
    )  # fmt: skip
    curves = telemetry.curves() if telemetry else {}
    writer.write_window({"loss": totals["loss"], "lr": lr, "images_per_s": images_per_s} | curves, global_step)


def topk_text(k: int | None, accuracy: float, digits: int = 2) -> str:
    """'  top5 93.10' for a log line, or '' when top-k is not reported (``k`` None)."""
    return f"  top{k} {accuracy:.{digits}f}" if k else ""


def _topk_fields(k: int | None, totals: dict) -> dict:
    return {"topk": totals["topk_acc"], "k": k} if k else {}


def write_train_record(
    writer, epoch: int, totals: dict, k: int | None, lr: float, step: int, fp16: bool, im_size: int
) -> None:
    """Append the epoch's training line (``epoch`` 1-based; ``im_size``, the crop it trained at) to metrics.jsonl."""
    warn_skipped_images("training", epoch, totals)
    skipped = int(totals["skipped_steps"])
    writer.write(
        {
            "epoch": epoch,
            "split": "train",
            "loss": totals["loss"],
            "top1": totals["top1_acc"],
            **_topk_fields(k, totals),
            "lr": lr,
            "images_per_s": totals["samples"] / max(totals["time_s"], 1e-9),
            "time_s": totals["time_s"],
            "samples": int(totals["samples"]),
            "nonfinite_steps": 0 if fp16 else skipped,
            "skipped_images": int(totals["skipped_images"]),
            "scaler_skips": skipped if fp16 else 0,
            "step": step,
            "im_size": im_size,
            # An epoch taken up again by a later start (its sums are the whole epoch's): the steps where it was.
            **({"resumed_at_steps": totals["resumed_at_steps"]} if totals.get("resumed_at_steps") else {}),
            **{f: totals[f] for f in TELEMETRY_FIELDS if f in totals},
        }
    )


def write_eval_record(
    writer, split: str, epoch: int, totals: dict, k: int | None, weights: str = "model", best: str | None = None,
    checkpoint: dict | None = None, precise_bn_s: float | None = None,
) -> None:  # fmt: skip
    """Append an evaluation line (val or test) to metrics.jsonl; ``best``: the metric (TRAIN.BEST_METRIC)
    by which this evaluation is the run's new best, which the summary reads back; ``checkpoint``: the
    checkpoint that holds the weights evaluated (``checkpoint_field``); ``precise_bn_s``: the time
    precise BN took before it."""
    warn_skipped_images(f"{split} ({weights} weights)", epoch, totals)
    writer.write(
        {
            "epoch": epoch,
            "split": split,
            "weights": weights,
            "loss": totals["loss"],
            "top1": totals["top1_acc"],
            **_topk_fields(k, totals),
            **{f: totals[f] for f in MULTILABEL_FIELDS if f in totals},
            "images_per_s": totals["images_per_s"],
            "time_s": totals["time_s"],
            "samples": int(totals["samples"]),
            "skipped_images": int(totals["skipped_images"]),
            **({"best": best} if best else {}),
            **({"checkpoint": checkpoint} if checkpoint else {}),
            **({"precise_bn_s": precise_bn_s} if precise_bn_s is not None else {}),
            **({"tta": totals["tta"]} if totals.get("tta") else {}),
        }
    )


DIGEST_CHARS = 16  # of the weights' SHA-256: enough to tell any two checkpoints apart, short enough to read


def checkpoint_field(path: str, epoch: int, sha256: str | None) -> dict:
    """What an evaluation record names of the checkpoint it evaluated: its absolute path, its epoch and
    a prefix of its weights' SHA-256 (``weights_digest``; None where no rank holds them whole)."""
    return {"path": os.path.abspath(path), "epoch": epoch, "sha256": sha256[:DIGEST_CHARS] if sha256 else None}


def tta_text(record: dict) -> str:
    """', flip TTA' for an evaluation scored with TEST.TTA, else ''."""
    return f", {record['tta']} TTA" if record.get("tta") else ""


def evaluation_line(what: str, totals: dict, k: int | None) -> str:
    """An evaluation's log line: ``what``, then its loss, top-1 (and top-k), mAP and F1 (multi-label), speed."""
    return (
        f"{what}: loss {totals['loss']:.4f}  top1 {totals['top1_acc']:.2f}{topk_text(k, totals['topk_acc'])}"
        f"{multilabel_text(totals)}  ({totals['samples']:.0f} images{tta_text(totals)}, {totals['images_per_s']:.0f} img/s)"
    )


def warn_skipped_images(what: str, epoch: int, totals: dict) -> None:
    """One warning (rank 0's: the totals are reduced) for the images DATA.BAD_IMAGE skip skipped."""
    if int(totals["skipped_images"]):
        logger.warning(
            "%s, epoch %d: skipped %d unreadable image(s) (DATA.BAD_IMAGE skip; skipped_images in metrics.jsonl)",
            what, epoch, int(totals["skipped_images"]), extra=SAME_ON_EVERY_RANK,
        )  # fmt: skip


def multilabel_text(totals: dict, digits: int = 2) -> str:
    """'  mAP 71.20  F1 65.00 (micro 70.10)' for a multi-label evaluation's log line, else ''."""
    if "map" not in totals:
        return ""
    return (
        f"  mAP {totals['map']:.{digits}f}  F1 {totals['f1_macro']:.{digits}f} (micro {totals['f1_micro']:.{digits}f})"
    )


def hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# What TensorBoard and the trackers plot: the rest of a metrics.jsonl record (samples, step,
# time_s, skipped counts) is bookkeeping, kept in metrics.jsonl and out of the scalar dashboard.
CURVES = (
    "loss", "top1", "topk", "map", "f1_macro", "f1_micro", "lr", "images_per_s", "data_share", "step_s_median",
    "step_s_max", "tflops", "mfu",
)  # fmt: skip
WINDOW_PREFIX = "train_step"  # the PRINT_FREQ windows' tags, against the global optimizer step


def epoch_curves(record: dict) -> dict[str, float]:
    """An epoch record's scalars by tag: ``SPLIT/top1``, ``SPLIT/top5`` (the record's k), ``val_ema/loss``, ..."""
    prefix = record["split"] + ("_ema" if record.get("weights") == "ema" else "")
    # metrics.jsonl keeps "topk" with "k" beside it (its readers key on that); a dashboard tag has no "k" beside it.
    names = {"topk": f"top{record['k']}"} if "k" in record else {}
    return {
        f"{prefix}/{names.get(key, key)}": record[key] for key in CURVES if isinstance(record.get(key), (int, float))
    }


class MetricsWriter:
    """Appends one JSON object per line to OUT_DIR/metrics.jsonl; plots the curves in TensorBoard and trackers."""

    def __init__(
        self,
        out_dir: str,
        tensorboard: bool = True,
        plot: bool = True,
        trackers: TrackerSettings | None = None,
        config_changes: list | None = None,
    ):
        """``plot``: draw metrics.png with the summary; ``trackers``: the ones to send the curves to;
        ``config_changes``: the run's (key, default, value) that the summary lists."""
        self.path, self.out_dir = os.path.join(out_dir, METRICS_FILE), out_dir
        self.plot, self.config_changes = plot, config_changes or []
        repair_torn_tail(self.path)  # a run that died mid-append: the next record must not join its half line
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
        self.trackers = None
        if trackers is not None and trackers.names:
            from distribuuuu.records.tracking import Trackers  # only a run that asks for trackers imports them

            self.trackers = Trackers(trackers, out_dir)

    def write(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl; an epoch record's curves also go to TensorBoard and the trackers."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "epoch" in record:
            self._plot(epoch_curves(record), "epoch", record["epoch"])

    def write_window(self, values: dict, global_step: int) -> None:
        """Plot one PRINT_FREQ window's values (host floats the sync point already has) at ``global_step``."""
        self._plot({f"{WINDOW_PREFIX}/{k}": v for k, v in values.items()}, "global_step", global_step)

    def _plot(self, scalars: dict, axis: str, step: int) -> None:
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.trackers is not None:
            self.trackers.log(scalars, axis, step)

    def summarize(self) -> None:
        """Write OUT_DIR/summary.md (and the plot) at the end of training, and log the summary."""
        from distribuuuu.records.summary import write_summary

        summary_log = get_logger("summary")
        try:
            summary_log.info("run summary:\n%s", write_summary(self.out_dir, self.plot, self.config_changes))
        except (MetricsError, OSError) as e:  # the run itself is done and saved: a summary never fails it
            summary_log.warning("no run summary: %s", e)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close()


class NullWriter:
    """The metrics writer of non-main ranks: does nothing."""

    def write(self, record: dict) -> None:
        pass

    def write_window(self, values: dict, global_step: int) -> None:
        pass

    def summarize(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_writer(out_dir: str, is_main: bool, **options) -> MetricsWriter | NullWriter:
    """A MetricsWriter on the main process (with ``options``: MetricsWriter's), a NullWriter elsewhere."""
    return MetricsWriter(out_dir, **options) if is_main else NullWriter()
