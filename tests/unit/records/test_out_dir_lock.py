"""One run per OUT_DIR: a second run into a held folder stops in one line naming the holder; a
holder that is gone (its process ended on this host, or its lock untouched on any host) is taken
over; a requeued job waits a bounded time for its predecessor."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distribuuuu.records import out_dir_lock
from distribuuuu.records.out_dir_lock import LOCK_NAME, Holder, OutDirBusy, OutDirLock


def _write_lock(out: Path, holder: Holder, age_s: float = 0.0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    path.write_text(json.dumps(holder.__dict__))
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # ended and reaped: no process has it (for the moment a test needs)


def test_a_held_out_dir_is_refused_in_one_line_naming_the_holder_and_its_lock(tmp_path):
    held = OutDirLock(str(tmp_path / "out"), stale_s=60)
    held.acquire()
    try:
        with pytest.raises(OutDirBusy) as e:
            OutDirLock(str(tmp_path / "out"), stale_s=60).acquire()
        me = socket.gethostname()
        assert "\n" not in str(e.value) and f"host {me}, pid {os.getpid()}" in str(e.value)
        assert str(tmp_path / "out" / LOCK_NAME) in str(e.value)
    finally:
        held.release()
    assert not (tmp_path / "out").exists(), "the lock's run made OUT_DIR and left it empty: it is gone"


def test_a_lock_whose_process_ended_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    gone = Holder(socket.gethostname(), _dead_pid(), time.time(), "1")
    _write_lock(tmp_path, gone)
    lock = OutDirLock(str(tmp_path), stale_s=3600)
    with caplog.at_level("WARNING", logger="distribuuuu"):
        lock.acquire()
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert f"took over the lock of a run that is gone (host {gone.host}, pid {gone.pid}" in caplog.text
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path):
    """The holder's pid now runs another process (this one): its start time tells them apart."""
    _write_lock(tmp_path, Holder(socket.gethostname(), os.getpid(), time.time(), "not-this-start"))
    lock = OutDirLock(str(tmp_path), stale_s=3600)
    lock.acquire()
    lock.release()


def test_a_holder_on_another_host_is_waited_for_until_its_lock_goes_untouched(tmp_path):
    other = Holder("node-2", 4242, time.time() - 50)
    _write_lock(tmp_path, other, age_s=5)  # touched 5 s ago: alive, whatever its pid is here
    with pytest.raises(OutDirBusy, match="host node-2, pid 4242"):
        OutDirLock(str(tmp_path), stale_s=60).acquire()
    _write_lock(tmp_path, other, age_s=61)  # untouched for longer than stale_s: its run is gone
    lock = OutDirLock(str(tmp_path), stale_s=60)
    lock.acquire()
    lock.release()


def test_a_restarted_job_waits_for_its_predecessor_to_let_go(tmp_path, monkeypatch):
    predecessor = OutDirLock(str(tmp_path), stale_s=60)
    predecessor.acquire()
    threading.Timer(1.5, predecessor.release).start()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert out_dir_lock.is_a_restart()
    start = time.monotonic()
    lock = OutDirLock(str(tmp_path), stale_s=60, wait_s=30)
    lock.acquire()
    lock.release()
    assert 1.0 < time.monotonic() - start < 30


def test_the_holder_touches_its_lock_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(out_dir_lock, "REFRESH_S", 0.2)
    lock = OutDirLock(str(tmp_path), stale_s=60)
    lock.acquire()
    try:
        old = time.time() - 100
        os.utime(tmp_path / LOCK_NAME, (old, old))
        time.sleep(1.0)
        assert time.time() - (tmp_path / LOCK_NAME).stat().st_mtime < 5
    finally:
        lock.release()
