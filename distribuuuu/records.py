"""One epoch's numbers -> the log line, metrics.jsonl and TensorBoard (takes values, not a Run)."""

from __future__ import annotations

from yacs.config import CfgNode

from distribuuuu.logger import get_logger
from distribuuuu.progress import WINDOW

logger = get_logger("trainer")  # the training log's own name: its lines read as the trainer's


def log_train_window(
    writer, totals: dict, epoch: int, step: int, cfg: CfgNode, steps_per_epoch: int, *, lr: float, elapsed_s: float,
    data_s: float, steps: int, steps_left: int, fp16: bool, global_step: int,
) -> None:  # fmt: skip
    """Log one PRINT_FREQ window of training (loss, accuracy, LR, speed, data wait, ETA) and plot it.

    Only host values of the sync point: the reduced ``totals`` and the host clock. The log record
    carries the window's numbers for the terminal's progress bar (progress.py).
    """
    eta_s = elapsed_s / max(steps, 1) * steps_left
    images_per_s = totals["samples"] / max(elapsed_s, 1e-9)
    skipped = int(totals["skipped_steps"])
    what = "fp16 overflow steps skipped" if fp16 else "non-finite steps skipped"
    bar = {
        "epoch": epoch + 1, "max_epoch": cfg.OPTIM.MAX_EPOCH, "step": step, "steps_per_epoch": steps_per_epoch,
        "loss": totals["loss"], "images_per_s": images_per_s, "eta": hms(eta_s),
    }  # fmt: skip
    logger.info(
        "epoch %d/%d  step %d/%d  loss %.4f  top1 %.2f  top%d %.2f  lr %.5g  %.0f img/s  data %.3fs/step  eta %s%s",
        epoch + 1, cfg.OPTIM.MAX_EPOCH, step, steps_per_epoch, totals["loss"], totals["top1_acc"],
        cfg.TRAIN.TOPK, totals["topk_acc"], lr, images_per_s,
        data_s / max(steps, 1), hms(eta_s), f"  {what} {skipped}" if skipped else "", extra={WINDOW: bar},
    )  # fmt: skip
    writer.write_window({"loss": totals["loss"], "lr": lr, "images_per_s": images_per_s}, global_step)


def write_train_record(writer, epoch: int, totals: dict, k: int, lr: float, step: int, fp16: bool) -> None:
    """Append the epoch's training line (``epoch`` 1-based) to metrics.jsonl."""
    skipped = int(totals["skipped_steps"])
    writer.write(
        {
            "epoch": epoch,
            "split": "train",
            "loss": totals["loss"],
            "top1": totals["top1_acc"],
            "topk": totals["topk_acc"],
            "k": k,
            "lr": lr,
            "images_per_s": totals["samples"] / max(totals["time_s"], 1e-9),
            "time_s": totals["time_s"],
            "samples": int(totals["samples"]),
            "nonfinite_steps": 0 if fp16 else skipped,
            "skipped_images": int(totals["skipped_images"]),
            "scaler_skips": skipped if fp16 else 0,
            "step": step,
        }
    )


def write_eval_record(writer, split: str, epoch: int, totals: dict, k: int, weights: str = "model") -> None:
    """Append an evaluation line (val or test) to metrics.jsonl."""
    writer.write(
        {
            "epoch": epoch,
            "split": split,
            "weights": weights,
            "loss": totals["loss"],
            "top1": totals["top1_acc"],
            "topk": totals["topk_acc"],
            "k": k,
            "images_per_s": totals["images_per_s"],
            "time_s": totals["time_s"],
            "samples": int(totals["samples"]),
            "skipped_images": int(totals["skipped_images"]),
        }
    )


def hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
