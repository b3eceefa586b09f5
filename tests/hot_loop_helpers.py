"""The hot-loop checks (tests/unit/training/test_hot_loop.py, its two-process job in
tests/integration/test_hot_loop_runs.py; the writer and progress-bar variant in
tests/integration/test_export_and_tracking.py): every public collective of ``torch.distributed`` and every
host-sync method of ``torch.Tensor`` wrapped to record the step at which it was called while
``trainer.train_epoch`` trains 25 steps on the embedded digits with PRINT_FREQ 10, and the checks on
what was recorded. ``_worker`` is one rank of the two-process job (tests/scripts/hot_loop_job.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import REPO
from torch import nn

from distribuuuu import trainer
from distribuuuu.config import load_cfg
from distribuuuu.models import register_model
from distribuuuu.records.meters import MetricSums
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import cleanup_distributed, setup_distributed
from distribuuuu.training.session import Session
from distribuuuu.training.state import Window

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "gather", "gather_object", "scatter", "scatter_object_list",
    "send", "recv", "isend", "irecv", "monitored_barrier",
)  # fmt: skip
HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
STEPS, PRINT_FREQ = 25, 10
SYNC_STEPS = [10, 20, 25]  # every PRINT_FREQ-th step and the epoch's last
HOT_LOOP_JOB = str(REPO / "tests" / "scripts" / "hot_loop_job.py")


class TinyNet(nn.Module):
    """Conv-BN-ReLU and a linear head: the loop, not the model, is under test."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2)
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@register_model("hot_loop_tiny")
def hot_loop_tiny(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return TinyNet(num_classes)


def hot_loop_cfg(world_size: int, precision: str = "fp32"):
    """25 steps per epoch of the digits' val split (361 images: quick to decode), sync every 10 steps."""
    batch = 361 // world_size // STEPS  # 14 for one rank, 7 for two: 25 full batches each
    return load_cfg(
        None,
        [
            "MODEL.ARCH", "hot_loop_tiny", "TRAIN.DATASET", str(REPO / "data" / "digits"), "TRAIN.SPLIT", "val", "TEST.DATASET", str(REPO / "data" / "digits"), "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
            "TRAIN.BATCH_SIZE", str(batch), "TRAIN.PRINT_FREQ", str(PRINT_FREQ), "OPTIM.MAX_EPOCH", "2",
            "TRAIN.PRECISION", precision,
        ],
    )  # fmt: skip


def _digits_run(env: DistEnv, precision: str = "fp32") -> trainer.Run:
    torch.manual_seed(0)
    run = trainer.build_run(hot_loop_cfg(env.world_size, precision), env)
    run.train.sampler.set_epoch(0)
    return run


def with_batches(run: trainer.Run, batches: list) -> trainer.Run:
    """The run with its train loader replaced by already decoded batches."""
    return dataclasses.replace(run, train=dataclasses.replace(run.train, loader=batches))


@contextlib.contextmanager
def recording(run: trainer.Run):
    """Record (kind, name, step_in_epoch) for every collective and host sync while inside."""
    calls: list[tuple[str, str, int]] = []
    patched = [(dist, name, "collective") for name in COLLECTIVES if hasattr(dist, name)]
    patched += [(torch.Tensor, name, "host_sync") for name in HOST_SYNCS]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]

    def wrap(fn, kind: str, name: str):
        def recorded(*args, **kwargs):
            calls.append((kind, name, run.state.step_in_epoch))
            return fn(*args, **kwargs)

        return recorded

    try:
        for (owner, name, kind), (_, _, fn) in zip(patched, originals):
            setattr(owner, name, wrap(fn, kind, name))
        yield calls
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def record_epoch(run: trainer.Run, start: int = 0, writer=None) -> list[tuple[str, str, int]]:
    """Train one epoch from step ``start`` while recording collectives and host syncs (records to ``writer``)."""
    run.state = run.at_step(0, start)
    session = Session(run.cfg, env=run.env)
    session.writer = writer or session.writer
    with recording(run) as calls:
        trainer.train_epoch(run, session, 0)
    return list(calls)


@contextlib.contextmanager
def gathered_times():
    """Record, at each sync point, the step time and data wait this rank wrote into its slots and the
    lists of every rank's that the window's one all-reduce returned."""
    seen, reduce = [], Window.reduce

    def recording(self, rank, *args, **kwargs):
        totals = reduce(self, rank, *args, **kwargs)
        slots = self.sums.sums[len(MetricSums.FIELDS) :].tolist()  # this rank's own, unreduced
        ranks = self.sums.ranks
        own = {"rank_step_s": slots[rank], "rank_data_s": slots[ranks + rank]}
        seen.append(
            {"rank": rank, "own": own, "rank_step_s": totals["rank_step_s"], "rank_data_s": totals["rank_data_s"]}
        )
        return totals

    Window.reduce = recording
    try:
        yield seen
    finally:
        Window.reduce = reduce


def check_gathered(seen: list, world_size: int) -> None:
    """Every sync point's lists hold each rank's own value in its slot (a sum with zeros elsewhere is the
    gather), a step time above its data wait, for ``world_size`` ranks."""
    assert len(seen) == len(SYNC_STEPS)
    for record in seen:
        for field in ("rank_step_s", "rank_data_s"):
            assert len(record[field]) == world_size
            assert record[field][record["rank"]] == record["own"][field]
        assert all(step > data >= 0 for step, data in zip(record["rank_step_s"], record["rank_data_s"]))


def check_collectives(calls: list, first_step: int = 0) -> None:
    """Assert exactly one collective, the metrics all-reduce, at each sync point and none between."""
    expected = [s for s in SYNC_STEPS if s > first_step]
    collectives = [(name, step) for kind, name, step in calls if kind == "collective"]
    assert collectives == [("all_reduce", s) for s in expected], (
        f"collectives outside the sync points {expected} (name, step_in_epoch when called): {collectives}"
    )


def check_host_syncs(calls: list, first_step: int = 0) -> None:
    """Assert the host waits for the device only at the sync points."""
    expected = [s for s in SYNC_STEPS if s > first_step]
    steps = sorted({step for kind, _, step in calls if kind == "host_sync"})
    assert steps == expected, f"host syncs at steps {steps}, expected only at {expected}: {calls}"


@contextlib.contextmanager
def one_rank_group():
    """An in-process gloo group of one rank: every collective really runs, no port needed."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(out_dir: str, precisions: list[str]) -> None:
    """One rank of the two-process job: record an epoch per precision and write what was called."""
    env = setup_distributed("gloo", 300)
    try:
        for precision in precisions:
            run = _digits_run(env, precision)
            run = with_batches(run, list(run.train.loader))
            with gathered_times() as seen:
                calls = record_epoch(run)
            record = {
                "ddp": isinstance(run.forward_model, nn.parallel.DistributedDataParallel),
                "steps_per_epoch": run.steps_per_epoch,
                "calls": calls,
                "gathered": seen,
            }
            Path(out_dir, f"{precision}_rank{env.rank}.json").write_text(json.dumps(record))
    finally:
        cleanup_distributed()
