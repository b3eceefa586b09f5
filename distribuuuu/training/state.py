"""What one training run holds: its position (``TrainState``), its best evaluation (``Best``), and the
``Run`` itself, built once by ``training/run.py`` and read by the loops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu.config import BEST_METRICS
from distribuuuu.data import Split
from distribuuuu.records.meters import MetricSums
from distribuuuu.records.telemetry import Telemetry
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.distillation import Teacher
from distribuuuu.training.ema import ModelEMA
from distribuuuu.training.task import Task


@dataclass
class TrainState:
    """Where a run is: what a checkpoint restores and a resume continues from."""

    epoch: int = 0  # completed epochs
    step_in_epoch: int = 0  # optimizer steps done in the epoch in progress
    samples_in_epoch: int = 0  # global position in the epoch's permutation: samples all ranks consumed


class Best:
    """The best evaluation so far by TRAIN.BEST_METRIC: its direction, value and weights, decided here
    alone. Checkpoints keep it (``state_dict``), and the val record that set it says so (its
    ``best`` field, written by ``records/writer.py``), which is what the run's summary reads back."""

    def __init__(self, metric: str = "top1"):
        self.metric = metric
        self.field, self.lower_is_better = BEST_METRICS[metric]
        self.value: float | None = None  # None: nothing evaluated yet
        self.top1 = 0.0  # the best evaluation's top-1: "best_acc1", which the tools read
        self.weights = "model"  # which weights reached it: "model" or "ema"

    def improves(self, totals: dict) -> bool:
        """Whether ``totals`` (an evaluation's) beats the best so far; top-1 as always: above the best."""
        if self.metric == "top1":
            return totals["top1_acc"] > self.top1
        value = totals[self.field]
        if self.value is None:
            return True
        return value < self.value if self.lower_is_better else value > self.value

    def take(self, totals: dict, weights: str) -> None:
        """Make ``totals`` (of the ``weights``, "model" or "ema") the best."""
        self.top1, self.weights = totals["top1_acc"], weights
        self.value = totals["top1_acc" if self.field == "top1" else self.field]

    def state_dict(self) -> dict:
        return {
            "best_acc1": self.top1,
            "best_weights": self.weights,
            "best_metric": self.metric,
            "best_value": self.value,
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a checkpoint's best; one chosen by another metric (or before metrics were recorded) is
        not this run's: the next evaluation sets it."""
        self.top1, self.weights = state["best_acc1"], state.get("best_weights", "model")
        same = state.get("best_metric", "top1") == self.metric
        self.value = state.get("best_value", self.top1) if same else None


class Window:
    """One PRINT_FREQ window of training steps: their metric sums on the device, their losses (to
    name a non-finite step), how long they took and how long they waited for data."""

    def __init__(self, device: torch.device, k: int, world_size: int = 1):
        self.sums, self.losses = MetricSums(device, k, ranks=world_size), []
        self.data_s, self.started = 0.0, time.perf_counter()

    def reduce(self, rank: int, stop: bool = False, interrupt: bool = False) -> dict:
        """Reduce the window over the ranks in one all-reduce: its metric sums, the stop flags (preemption,
        Ctrl-C) and, in this rank's slots, its seconds a step and waiting for data a step (host clocks
        read here: every rank's arrive in the totals' ``rank_step_s`` and ``rank_data_s``)."""
        steps = max(len(self.losses), 1)
        self.sums.add_field("stop", float(stop))
        self.sums.add_field("interrupt", float(interrupt))
        times = {"rank_step_s": (time.perf_counter() - self.started) / steps, "rank_data_s": self.data_s / steps}
        self.sums.set_rank_values(rank, times)
        return self.sums.reduce()

    def next_batches(self, batches, count: int) -> list:
        """The next ``count`` (micro-)batches, the wait for them counted as data time."""
        tic = time.perf_counter()
        micro_batches = [next(batches) for _ in range(count)]
        self.data_s += time.perf_counter() - tic
        return micro_batches

    def reset(self) -> None:
        self.sums.reset()
        self.losses.clear()
        self.data_s, self.started = 0.0, time.perf_counter()


class EpochTotals:
    """The training sums of the epoch in progress across every start that trained it, its seconds and
    the steps at which it was resumed: what its train record reports. Checkpoints keep them (the
    ``epoch_totals`` component), so the record of an epoch resumed mid-way is the whole epoch's."""

    def __init__(self):
        self.sums = MetricSums(torch.device("cpu"), 1)  # reduced totals are added, never batches: k is unused
        self.carried_s = 0.0  # seconds the earlier starts trained this epoch
        self.resumed_at: list[int] = []  # the step at which each later start took it up
        self.started = time.perf_counter()

    def begin(self, step: int) -> None:
        """This start trains the epoch from ``step`` on: at its first step, a new epoch (nothing carried)."""
        if step == 0:
            self.sums.reset()
            self.carried_s, self.resumed_at = 0.0, []
        self.started = time.perf_counter()

    def add(self, totals: dict) -> None:
        """Add a window's totals (``MetricSums.reduce``'s, the same on every rank)."""
        self.sums.add_totals(totals)

    def totals(self) -> dict:
        """The epoch's totals and means so far, with ``time_s`` (every start's) and ``resumed_at_steps``."""
        resumed = {"resumed_at_steps": list(self.resumed_at)} if self.resumed_at else {}
        return dict(self.sums.totals(), time_s=self.carried_s + time.perf_counter() - self.started, **resumed)

    def state_dict(self) -> dict:
        totals = self.totals()
        return {
            "sums": {f: totals[f] for f in MetricSums.FIELDS},
            "time_s": totals["time_s"],
            "resumed_at": list(self.resumed_at),
        }

    def resume(self, saved: dict | None, step: int) -> None:
        """Take up the epoch at ``step`` from a checkpoint's ``saved`` totals (None: one written before
        they were kept, whose record then covers the resumed steps alone)."""
        self.begin(0)
        if saved:
            self.sums.add_totals({f: float(saved["sums"].get(f, 0.0)) for f in MetricSums.FIELDS})
            self.carried_s, self.resumed_at = float(saved["time_s"]), [int(s) for s in saved["resumed_at"]]
        self.resumed_at.append(step)


@dataclass
class Run:
    """Everything one training run holds: built once by ``build_run``, then used by the loops."""

    cfg: CfgNode
    env: DistEnv
    model: nn.Module  # the plain (or, under fsdp/hsdp, sharded) model: what checkpoints hold
    forward_model: nn.Module  # what training calls: compiled and/or DDP-wrapped (or the sharded model)
    eval_model: nn.Module  # what evaluation calls: compiled or plain, never DDP (sharded under fsdp)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    task: Task  # multiclass or multilabel: the metrics, the val loss, the head's reading
    criterion: nn.Module  # the training loss (a DistillationLoss when there is a teacher)
    train: Split
    val: Split
    steps_per_epoch: int
    base_lr: float
    ema: ModelEMA | None = None
    mixer: object = None
    extra_val: dict[str, Split] = field(default_factory=dict)  # TEST.EXTRA_DATASETS by split name
    precise_bn: Split | None = None  # BN.PRECISE_IMAGES training images, when set
    teacher: Teacher | None = None  # DISTILL.TEACHER, frozen
    state: TrainState = field(default_factory=TrainState)
    best: Best = field(default_factory=Best)
    telemetry: Telemetry = field(default_factory=Telemetry)  # FLOPs, MFU, the ranks' step times
    epoch_totals: EpochTotals = field(default_factory=EpochTotals)  # the epoch in progress's record, across starts
    # Further state checkpointed with the run (name -> Stateful: state_dict()/load_state_dict()), for
    # a caller outside the package; the package's own is listed in components.run_components.
    registered_state: dict[str, object] = field(default_factory=dict)

    @property
    def global_step(self) -> int:
        return self.state.epoch * self.steps_per_epoch + self.state.step_in_epoch

    @property
    def global_batch(self) -> int:
        """Samples one optimizer step takes from the epoch's permutation, over all ranks."""
        return global_batch(self.cfg.TRAIN, self.env.world_size)

    def at_step(self, epoch: int, step_in_epoch: int) -> TrainState:
        """The state of this run ``step_in_epoch`` steps into ``epoch`` (0-based), on its own global batch."""
        return TrainState(epoch=epoch, step_in_epoch=step_in_epoch, samples_in_epoch=step_in_epoch * self.global_batch)

    def move_to(self, epoch: int, step_in_epoch: int = 0) -> None:
        """Put the run ``step_in_epoch`` steps into ``epoch`` (0-based): where the next ``train_epoch``
        continues (sampler, LR schedule) and what a checkpoint records."""
        self.state = self.at_step(epoch, step_in_epoch)

    @property
    def schedule_step(self) -> float:
        """The LR schedule's position in this run's steps: completed epochs plus the epoch's sample fraction.

        Counted from the global sample position, not from steps: a run resumed with another
        world size (another global batch) lands where the schedule was when it stopped.
        """
        return self.state.epoch * self.steps_per_epoch + self.state.samples_in_epoch / self.global_batch

    def position(self) -> str:
        """Where the run is, as messages name it (1-based epoch)."""
        return f"epoch {self.state.epoch + 1}, step {self.state.step_in_epoch}"


def global_batch(train_cfg: CfgNode, world_size: int = 1) -> int:
    """Samples one optimizer step takes over ``world_size`` ranks: TRAIN.BATCH_SIZE x ACCUM_STEPS x ranks."""
    return train_cfg.BATCH_SIZE * train_cfg.ACCUM_STEPS * world_size
