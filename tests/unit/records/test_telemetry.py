"""Telemetry: model FLOPs per image (torch's FlopCounterMode) against their closed form, TFLOP/s and
MFU against their formula, the straggler rule on made-up rank times, and a run's log line,
metrics.jsonl record and TensorBoard curves. That the times travel in the one all-reduce, with no
other collective or host sync: tests/unit/training/test_hot_loop.py.
"""

from __future__ import annotations

import logging
import re
import statistics

import pytest
import torch
from helpers import EVAL_TINY, TRAIN, assert_ok, in_process, read_metrics
from torch import nn

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.models import build_model
from distribuuuu.models.flops import TRAINING_FLOPS_PER_FORWARD, forward_flops
from distribuuuu.records.telemetry import Telemetry, straggler_score

# tests/models.py's tiny_cnn at 16 px: conv 3->8 (3x3) on 16x16, conv 8->16 (3x3) on 8x8 (after the
# pool), linear 16->10; 2 FLOPs a multiply-add. BatchNorm, ReLU and pooling are not counted (torch's
# counter counts matrix products and convolutions, as the MFU literature does).
TINY_CNN_FORWARD = 2 * (8 * 3 * 9 * 16 * 16 + 16 * 8 * 9 * 8 * 8 + 16 * 10)


def test_forward_flops_are_the_closed_form_and_leave_the_model_as_it_was():
    model = build_model("tiny_cnn", 10).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert forward_flops(model, 16, torch.device("cpu")) == TINY_CNN_FORWARD
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    linear = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 7))
    assert forward_flops(linear, 4, torch.device("cpu")) == 2 * 48 * 7


def tiny_cnn_forward(size: int) -> int:
    """TINY_CNN_FORWARD's closed form at any even ``size``."""
    return 2 * (8 * 3 * 9 * size * size + 16 * 8 * 9 * (size // 2) ** 2 + 16 * 10)


def test_a_progressive_run_counts_each_epochs_flops_at_the_size_it_trains_at(tmp_path):
    """Epochs at 8, 12 and 16 px (progressive resizing): each epoch's record counts its own size's
    FLOPs, not TRAIN.IM_SIZE's (which made a 8 px epoch's TFLOP/s 4x too high)."""
    assert tiny_cnn_forward(16) == TINY_CNN_FORWARD
    ramp = ["OPTIM.MAX_EPOCH", "3", "TRAIN.PROGRESSIVE_START_SIZE", "8", "TRAIN.PROGRESSIVE_SIZE_MULTIPLE", "4",
            "TRAIN.PROGRESSIVE_END_EPOCH", "2", "TRAIN.SPLIT", "val", "LOG.PLOT", "False"]  # fmt: skip
    assert_ok(in_process(TRAIN, "OUT_DIR", str(tmp_path), *EVAL_TINY, *ramp))
    trains = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert [r["im_size"] for r in trains] == [8, 12, 16]
    assert [r["flops_per_image"] for r in trains] == [
        TRAINING_FLOPS_PER_FORWARD * tiny_cnn_forward(s) for s in (8, 12, 16)
    ]


def test_a_distilled_runs_flops_add_the_teachers_forward():
    from distribuuuu.runtime.launcher import DistEnv
    from distribuuuu.training.distillation import Teacher
    from distribuuuu.training.run import build_telemetry

    cfg = load_cfg(None, [*EVAL_TINY, "MODEL.NUM_CLASSES", "10"])
    student, teacher = build_model("tiny_cnn", 10), Teacher(build_model("resnet18", 10).eval(), {})
    teacher_forward = forward_flops(torchvision_resnet18(), 16, torch.device("cpu"))
    telemetry = build_telemetry(cfg, student, DistEnv(), teacher)
    assert telemetry.flops_per_image == TRAINING_FLOPS_PER_FORWARD * TINY_CNN_FORWARD + teacher_forward
    assert teacher_forward > TINY_CNN_FORWARD  # the part that was left out was the larger


def torchvision_resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _totals(step_s: list[float], data_s: list[float], samples: float = 640.0) -> dict:
    return {"rank_step_s": step_s, "rank_data_s": data_s, "samples": samples}


def test_tflops_and_mfu_are_flops_per_image_times_images_per_second_over_devices_and_peak():
    telemetry = Telemetry(flops_per_image=3e9, peak_tflops=0.5)
    window = telemetry.window(_totals([0.2, 0.2, 0.2, 0.2], [0.01] * 4), 2.0, 10, "epoch 1, step 10", [])
    assert window.tflops == pytest.approx(3e9 * (640 / 2.0) / 4 / 1e12)  # 0.24 per device
    assert window.mfu == pytest.approx(window.tflops / 0.5)
    assert window.data_share == pytest.approx(0.05)
    assert Telemetry().window(_totals([0.2], [0.0]), 2.0, 10, "", []).mfu is None  # no FLOPs: none claimed


@pytest.mark.parametrize(
    ("step_s", "data_s", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0], [0.01, 0.01, 0.51, 0.01], 1.5),  # late with its batches: the others waited
        ([1.0, 1.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0], 2.0),  # slower steps of its own
        ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], 1.0),
    ],
)
def test_the_straggler_score_counts_median_steps_behind_the_others(step_s, data_s, expected):
    assert straggler_score(step_s, data_s, 2) == pytest.approx(expected)
    others = [straggler_score(step_s, data_s, r) for r in (0, 1, 3)]
    assert max(others) <= 1.0 + 1e-12  # the others are not behind anyone


def test_a_straggler_is_named_once_with_its_host_above_the_factor_only(caplog):
    step_s, data_s, hosts = [0.5, 0.5, 0.5, 0.5], [0.01, 0.01, 0.31, 0.01], ["a", "b", "node-7", "d"]
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        Telemetry(straggler_factor=1.7).window(_totals(step_s, data_s), 5.0, 10, "epoch 2, step 40", hosts)
        assert not caplog.records  # 1.6 median steps behind: below 1.7
        telemetry = Telemetry(straggler_factor=1.5)
        window = telemetry.window(_totals(step_s, data_s), 5.0, 10, "epoch 2, step 40", hosts)
    [record] = caplog.records
    assert record.getMessage().startswith("straggler at epoch 2, step 40: rank 2 on node-7 is 1.60 median steps behind")
    assert window.slowest == 2 and telemetry.end_epoch()["straggler_windows"] == 1


def test_the_epoch_record_weights_each_window_by_its_steps():
    telemetry = Telemetry(flops_per_image=1e9, peak_tflops=1.0)
    telemetry.window(_totals([0.1, 0.3], [0.0, 0.1], 320), 1.0, 10, "", [])  # 10 steps
    telemetry.window(_totals([0.2, 0.2], [0.0, 0.0], 160), 1.0, 5, "", [])  # 5 steps
    fields = telemetry.end_epoch()
    step = [(0.1 * 10 + 0.2 * 5) / 15, (0.3 * 10 + 0.2 * 5) / 15]
    assert fields["rank_step_s"] == pytest.approx(step)
    assert (fields["step_s_min"], fields["step_s_max"]) == pytest.approx((min(step), max(step)))
    assert fields["step_s_median"] == pytest.approx(statistics.median(step))
    assert fields["data_share"] == pytest.approx((0.1 * 10) / (0.4 * 10 + 0.4 * 5))
    assert fields["tflops"] == pytest.approx(1e9 * 480 / 2.0 / 2 / 1e12) and fields["mfu"] == fields["tflops"]
    assert telemetry.end_epoch() == {}  # counted again from the next window


def test_a_run_logs_records_and_plots_its_telemetry(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opts = [*EVAL_TINY, "TRAIN.SPLIT", "val", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "5", "LOG.PLOT", "False"]
    result = in_process(TRAIN, "OUT_DIR", str(tmp_path), *opts, "LOG.PEAK_TFLOPS", "0.01")
    assert_ok(result)
    lines = [line for line in result.stdout.splitlines() if "step 5/11" in line]
    assert lines and re.search(
        r" data [\d.]+s/step \(\d+%\)  step [\d.e-]+/[\d.e-]+/[\d.e-]+s slowest rank 0  ", lines[0]
    )
    assert " TFLOP/s  mfu " in lines[0], lines
    assert f"{TRAINING_FLOPS_PER_FORWARD * TINY_CNN_FORWARD / 1e9:.4g} GFLOP a training image" in result.stdout
    [train] = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert train["flops_per_image"] == TRAINING_FLOPS_PER_FORWARD * TINY_CNN_FORWARD
    assert train["mfu"] == pytest.approx(train["tflops"] / 0.01)
    assert len(train["rank_step_s"]) == 1 and 0 <= train["data_share"] < 1 and train["straggler_windows"] == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_step/data_share", "train_step/step_s_max", "train_step/mfu", "train/mfu"} <= tags, tags


def test_bad_telemetry_keys_are_one_config_error():
    with pytest.raises(ConfigError, match=r"^LOG.STRAGGLER_FACTOR must be 0 \(off\) or above 1"):
        load_cfg(None, ["LOG.STRAGGLER_FACTOR", "0.5"])
    with pytest.raises(ConfigError, match=r"^LOG.PEAK_TFLOPS must be >= 0"):
        load_cfg(None, ["LOG.PEAK_TFLOPS", "-1"])
