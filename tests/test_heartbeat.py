"""Heartbeats in the store: a rank whose heartbeat stops is named once, by the lowest rank still beating.

In-process: a TCPStore on 127.0.0.1 and one Heartbeat per simulated rank (threads); the two-process
job with a stopped rank is in test_faults.py.
"""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch.distributed as dist

from distribuuuu import heartbeat
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.heartbeat import Heartbeat, stall_seconds

STALL_S = 0.6


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


@pytest.fixture
def beating(store):
    """Start one Heartbeat per rank of a ``world``-rank job; all are stopped after the test."""
    started: list[Heartbeat] = []

    def start(world: int) -> list[Heartbeat]:
        started.extend(Heartbeat(store, r, world, STALL_S, timeout_s=60).start() for r in range(world))
        return started

    yield start
    for beat in started:
        beat.stop()


def _named(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "sent no heartbeat" in r.getMessage()]


def test_a_rank_whose_heartbeat_stops_is_named_once_by_rank_0(beating, caplog, monkeypatch):
    monkeypatch.setattr(heartbeat, "_position", lambda: "epoch 3, step 7")
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        ranks = beating(3)
        time.sleep(2 * STALL_S)
        assert _named(caplog) == [], "every rank beats"
        ranks[2].stop()  # as a stopped process: its thread writes nothing more
        time.sleep(6 * STALL_S)
    [line] = _named(caplog)
    assert line.startswith("rank 0: rank(s) [2] sent no heartbeat for 0.6s")
    assert ", last beat at epoch 3, step 7" in line and "DIST.TIMEOUT_S=60" in line


def test_when_rank_0_stops_the_next_rank_names_it(beating, caplog):
    with caplog.at_level(logging.ERROR, logger="distribuuuu.heartbeat"):
        ranks = beating(3)
        time.sleep(2 * STALL_S)
        ranks[0].stop()
        time.sleep(6 * STALL_S)
    [line] = _named(caplog)
    assert line.startswith("rank 1: rank(s) [0] sent no heartbeat")


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
