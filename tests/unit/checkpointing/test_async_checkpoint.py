"""Checkpoints written in the background: training goes on during a write, one write at a time, each
file holds the state of the step it was taken at, and the end of a run and a preemption wait for it.

The runs here are in this process: a gate holds each write until training has taken two more
steps (or until the trainer waits for the write), so what ran during a write is an order of
events, never a timing. A kill during a write, which needs a process, is in test_exact_resume.py.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import pytest
import torch
from helpers import DUMMY_OPTS, TINY_ARCH

from distribuuuu import cli, trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.background_write import BackgroundWriter, host_copy
from distribuuuu.checkpointing.manager import Checkpointer
from distribuuuu.runtime.preemption import EXIT_PREEMPTED, PreemptionHandler

pytestmark = pytest.mark.usefixtures("plain_logging")


# ------------------------------------------------------------------------------------------------
# The pieces
# ------------------------------------------------------------------------------------------------
def test_the_host_copy_of_host_tensors_is_a_real_copy_that_keeps_shared_tensors_shared():
    weight, step = torch.arange(4.0), torch.tensor(3)
    weights = OrderedDict(w=weight, tied=weight)
    weights._metadata = OrderedDict({"": {"version": 2}})
    state = {"model": weights, "optimizer": {"state": {0: {"step": step}}, "param_groups": [{"lr": 0.1}]}, "epoch": 1}
    copied = host_copy(state)
    weight.add_(1), step.add_(1)  # what the next optimizer step does to the live tensors
    assert torch.equal(copied["model"]["w"], torch.arange(4.0)) and copied["optimizer"]["state"][0]["step"] == 3
    assert copied["model"]["tied"] is copied["model"]["w"], "a tensor two entries share is copied once"
    assert copied["model"]._metadata == {"": {"version": 2}} and copied["epoch"] == 1


def test_a_write_waits_for_the_one_in_flight_and_its_error_is_raised_at_the_next_wait():
    writer, release, order = BackgroundWriter(), threading.Event(), []

    def first() -> None:
        order.append("first starts")
        release.wait(30)
        order.append("first ends")

    writer.submit(first)
    assert writer.in_flight
    releaser = threading.Timer(0.05, lambda: (order.append("released"), release.set()))
    releaser.start()
    writer.submit(lambda: order.append("second"))  # returns once the first is done
    writer.wait()
    assert order == ["first starts", "released", "first ends", "second"]

    def failing() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(failing)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # the error is raised once


# ------------------------------------------------------------------------------------------------
# A training run with gated writes
# ------------------------------------------------------------------------------------------------
class GatedWrites:
    """Records steps, background writes and waits in order; holds each background write until 2 steps
    ran or the trainer waits."""

    def __init__(self, monkeypatch, steps_per_write: int = 2):
        self.events: list[tuple] = []
        self.snapshots: dict[str, dict] = {}
        self.steps_per_write, self.in_flight, self.most_in_flight = steps_per_write, 0, 0
        self.cond = threading.Condition()
        self.steps = 0
        self.waiting = False
        real_complete = Checkpointer._complete  # a file's write, or the finish of a DCP folder, then the pruning
        real_step, real_save, real_wait = trainer.train_step, trainer.save_training_checkpoint, BackgroundWriter.wait

        def gated(checkpoints: Checkpointer, finish, path: str, *args):
            if threading.current_thread() is threading.main_thread():  # written at once: nothing to hold
                return real_complete(checkpoints, finish, path, *args)
            with self.cond:
                self.event("write starts", path)
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                started = self.steps
                released = self.cond.wait_for(
                    lambda: self.steps - started >= self.steps_per_write or self.waiting, timeout=60
                )
            assert released, "the gate was never released: training stopped while the write was in flight"
            real_complete(checkpoints, finish, path, *args)
            with self.cond:
                self.in_flight -= 1
                self.event("write ends", path)

        def train_step(run, micro_batches, sums):
            loss = real_step(run, micro_batches, sums)
            with self.cond:
                self.steps += 1
                self.event("step", run.global_step + 1)
                self.cond.notify_all()
            return loss

        def save_training_checkpoint(run, *args, **kwargs):
            # The state at the moment of the save, taken here by the test: what the file must hold.
            snapshot = copy.deepcopy({"model": run.model.state_dict(), "ema": run.ema.state_dict()})
            path = real_save(run, *args, **kwargs)
            self.snapshots[path] = snapshot
            return path

        def wait(writer):
            with self.cond:
                self.waiting = writer.in_flight
                if self.waiting:
                    self.event("trainer waits")
                self.cond.notify_all()
            try:
                real_wait(writer)
            finally:
                self.waiting = False

        monkeypatch.setattr(Checkpointer, "_complete", gated)
        monkeypatch.setattr(trainer, "train_step", train_step)
        monkeypatch.setattr(trainer, "save_training_checkpoint", save_training_checkpoint)
        monkeypatch.setattr(BackgroundWriter, "wait", wait)

    def event(self, *what) -> None:
        self.events.append(what)

    def writes(self) -> list[tuple[str, list[tuple]]]:
        """(path, the events between its start and its end) of every write, in order."""
        found = []
        for i, (kind, *rest) in enumerate(self.events):
            if kind == "write starts":
                end = self.events.index(("write ends", rest[0]), i)
                found.append((rest[0], self.events[i + 1 : end]))
        return found


def _args(out, fmt: str, *extra: str) -> list[str]:
    return ["DIST.CKPT_FORMAT", fmt,
        "OUT_DIR", str(out), *DUMMY_OPTS, "MODEL.ARCH", TINY_ARCH, "TRAIN.BATCH_SIZE", "8", "OPTIM.MAX_EPOCH", "2",
        "TRAIN.CKPT_PERIOD_ITERS", "3", "TRAIN.KEEP_CKPTS", "100", "OPTIM.EMA_DECAY", "0.9", "TRAIN.WORKERS", "0",
        *extra,
    ]  # fmt: skip


def _assert_holds_its_snapshot(path: str, snapshot: dict) -> None:
    saved = ckpt.load_checkpoint(path)
    for key, value in snapshot["model"].items():
        assert torch.equal(saved["model"][key], value), f"{path}: {key} is not the state of its step"
    for key, value in snapshot["ema"]["module"].items():
        assert torch.equal(saved["ema"]["module"][key], value), f"{path}: EMA {key} is not the state of its step"


@pytest.mark.slow  # a whole run, its plot and summary included (~15 s here)
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_training_goes_on_while_a_checkpoint_is_written_one_at_a_time_and_the_run_ends_with_it_on_disk(
    tmp_path, monkeypatch, fmt
):
    gate = GatedWrites(monkeypatch)
    out = tmp_path / "out"
    assert cli.run_tool(trainer.train_model, _args(out, fmt)) == 0
    writes = gate.writes()
    # 8 steps an epoch: checkpoints after steps 3 and 6, and each epoch's end; 2 epochs.
    names = [p.rsplit("/", 1)[1] for p, _ in writes]
    assert names == [ckpt.checkpoint_name(e, s, fmt == "sharded") for e in (1, 2) for s in (3, 6, 0)]
    assert gate.most_in_flight == 1
    for path, during in writes[:-1]:
        steps = [e for e in during if e[0] == "step"]
        assert len(steps) >= 2, f"no training while {path} was written: {during}"
    last_path, during_last = writes[-1]
    assert ("trainer waits",) in during_last, "the end of the run waited for its last write"
    assert gate.events[-1] == ("write ends", last_path), "nothing ran after the last write: the run ended on it"
    for path, snapshot in gate.snapshots.items():
        _assert_holds_its_snapshot(path, snapshot)
    assert (out / (ckpt.BEST_NAME if fmt == "file" else ckpt.BEST_SHARDED)).exists()


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_preemption_waits_for_the_write_in_flight_then_writes_its_own_before_exiting(tmp_path, monkeypatch, fmt):
    gate = GatedWrites(monkeypatch, steps_per_write=100)  # released only by the trainer's wait
    gated_step, handlers, real_enter = trainer.train_step, [], PreemptionHandler.__enter__

    def enter(handler: PreemptionHandler) -> PreemptionHandler:
        handlers.append(handler)
        return real_enter(handler)

    def train_step(run, micro_batches, sums):
        loss = gated_step(run, micro_batches, sums)
        if run.global_step + 1 == 4:  # a preemption signal's flag (the handler's timer left out)
            handlers[-1].signal_name = "SIGTERM"
        return loss

    monkeypatch.setattr(PreemptionHandler, "__enter__", enter)

    real_stop = trainer.stop_for_preemption

    def stop_for_preemption(*args, **kwargs):
        try:
            real_stop(*args, **kwargs)
        finally:
            gate.event("exits")

    monkeypatch.setattr(trainer, "train_step", train_step)
    monkeypatch.setattr(trainer, "stop_for_preemption", stop_for_preemption)
    out = tmp_path / "out"
    assert cli.run_tool(trainer.train_model, _args(out, fmt, "TRAIN.PRINT_FREQ", "2")) == EXIT_PREEMPTED
    writes = gate.writes()
    # After step 3 a background write; the stop agreed at step 4 (PRINT_FREQ 2) writes its own.
    # A preemption's own checkpoint is written at once, in the trainer's thread: no gate holds it.
    assert [p.rsplit("/", 1)[1] for p, _ in writes] == [ckpt.checkpoint_name(1, 3, fmt == "sharded")]
    assert ("step", 4) in writes[0][1] and ("trainer waits",) in writes[0][1]
    assert gate.events[-1] == ("exits",) and ("write ends", writes[0][0]) in gate.events
    assert set(gate.snapshots) == {
        writes[0][0],
        str(out / "checkpoints" / ckpt.checkpoint_name(1, 4, fmt == "sharded")),
    }
    for path, snapshot in gate.snapshots.items():
        _assert_holds_its_snapshot(path, snapshot)
