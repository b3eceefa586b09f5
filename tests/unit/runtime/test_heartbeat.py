"""Heartbeats in the store: a rank whose heartbeat stops is named once, by the lowest rank still beating.

In-process: a TCPStore on 127.0.0.1 and one Heartbeat per simulated rank (threads); the two-process
job with a stopped rank is in test_kills_and_restarts.py.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import pytest
import torch.distributed as dist

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.runtime import heartbeat
from distribuuuu.runtime.heartbeat import Heartbeat, stall_seconds

STALL_S = 0.6


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


class _Freezable:
    """A rank's view of the store that blocks every call once frozen: the process was stopped (SIGSTOP)."""

    def __init__(self, store: dist.Store):
        self.store, self.frozen, self.thawed = store.clone(), threading.Event(), threading.Event()

    def clone(self) -> _Freezable:
        return self

    def __getattr__(self, name):
        def call(*args):
            if self.frozen.is_set():
                self.thawed.wait()
            return getattr(self.store, name)(*args)

        return call


@pytest.fixture
def beating(store):
    """Start one Heartbeat per rank of a ``world``-rank job; each rank's store view can be frozen."""
    started: list[tuple[Heartbeat, _Freezable]] = []

    def start(world: int) -> list[tuple[Heartbeat, _Freezable]]:
        views = [_Freezable(store) for _ in range(world)]
        started.extend((Heartbeat(v, r, world, STALL_S, timeout_s=60).start(), v) for r, v in enumerate(views))
        return started

    yield start
    for beat, view in started:
        view.thawed.set()
        beat.stop()


def _named(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "sent no heartbeat" in r.getMessage()]


def _named_once(caplog) -> list[str]:
    """The lines naming a stalled rank, once one came (within 6 stall periods) and 2 more periods passed."""
    deadline = time.monotonic() + 6 * STALL_S
    while not _named(caplog) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2 * STALL_S)  # time for a second line, which must not come
    return _named(caplog)


def test_a_rank_whose_heartbeat_stops_is_named_once_by_rank_0(beating, caplog, monkeypatch):
    monkeypatch.setattr(heartbeat, "_position", lambda: "epoch 3, step 7")
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        ranks = beating(3)
        time.sleep(2 * STALL_S)
        assert _named(caplog) == [], "every rank beats"
        ranks[2][1].frozen.set()  # as a stopped process: its thread writes nothing more
        [line] = _named_once(caplog)
    assert line.startswith("rank 0: rank(s) [2] sent no heartbeat for 0.6s")
    assert ", last beat at epoch 3, step 7" in line and "DIST.TIMEOUT_S=60" in line


def test_when_rank_0_stops_the_next_rank_names_it(beating, caplog):
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        ranks = beating(3)
        time.sleep(2 * STALL_S)
        ranks[0][1].frozen.set()
        [line] = _named_once(caplog)
    assert line.startswith("rank 1: rank(s) [0] sent no heartbeat")


def test_a_rank_that_stops_beating_on_purpose_is_not_named(beating, caplog):
    # cleanup_distributed stops the thread: a rank that ends before its peers (rank 0 still writes
    # the run's summary) did not stall.
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        ranks = beating(2)
        time.sleep(2 * STALL_S)
        ranks[1][0].stop()
        time.sleep(6 * STALL_S)
    assert _named(caplog) == []


def test_a_busy_main_thread_keeps_beating(beating, caplog):
    # The thread beats while the main thread works (a long checkpoint write, an evaluation):
    # no false alarm, even for many times the stall threshold.
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        beating(2)
        deadline = time.monotonic() + 5 * STALL_S
        while time.monotonic() < deadline:
            sum(i * i for i in range(10_000))  # holds the GIL between the interpreter's switches
    assert _named(caplog) == []


def test_stop_ends_the_thread_and_leaves_the_store_timeout_alone(store):
    before = store.timeout
    beat = Heartbeat(store, 0, 2, STALL_S, timeout_s=60).start()
    beat.stop()
    assert not beat._thread.is_alive()
    assert store.timeout == before, "the thread's short timeout is on its own clone of the store"


def test_stall_threshold_defaults_below_the_collective_timeout_and_is_validated():
    assert stall_seconds(0, 600) == 120 and stall_seconds(0, 30) == 15 and stall_seconds(5, 30) == 5
    with pytest.raises(ConfigError, match="DIST.STALL_S"):
        load_cfg(None, ["DIST.TIMEOUT_S", "30", "DIST.STALL_S", "30"])
