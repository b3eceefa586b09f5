"""Two real runs started together into one OUT_DIR (on one host, and on two host names sharing it): one
trains, the other stops in one line naming it. The launches of tests/unit/records/test_out_dir_lock.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY_TRAIN, clean_env, read_metrics

from distribuuuu.records.out_dir_lock import LOCK_NAME

DIGITS = str(REPO / "data" / "digits")
TINY = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "2",
    "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS,
]  # fmt: skip


def _start(out: Path, log: Path, hostname: str = "") -> subprocess.Popen:
    cmd = [sys.executable, TINY_TRAIN, "OUT_DIR", str(out), *TINY]
    if hostname:  # a host of its own: a UTS namespace with another host name, the same file system
        cmd = ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *cmd]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=f)


def _two_runs_at_once(tmp_path: Path, hostnames: tuple[str, str]) -> None:
    out = tmp_path / "out"
    logs = [tmp_path / "a.err", tmp_path / "b.err"]
    procs = [_start(out, log, host) for log, host in zip(logs, hostnames)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert sorted(codes) == [0, 2], codes
    loser = logs[codes.index(2)].read_text()
    errors = [line for line in loser.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and "is in use by another run (host " in errors[0], loser[-2000:]
    winner_host = hostnames[codes.index(0)] or socket.gethostname()
    assert f"(host {winner_host}, pid " in errors[0], errors[0]
    # The run that trained wrote every record once; the lock went with it.
    train = [r["epoch"] for r in read_metrics(out) if r["split"] == "train"]
    assert train == [1, 2] and not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_runs_started_together_into_one_out_dir_one_trains_the_other_stops_naming_it(tmp_path):
    _two_runs_at_once(tmp_path, ("", ""))


@pytest.mark.slow
def test_two_runs_on_two_hosts_sharing_one_out_dir(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("two host names need a UTS namespace (unshare, as root)")
    if subprocess.run(["unshare", "--uts", "hostname", "probe"], capture_output=True).returncode:
        pytest.skip("unshare --uts is refused here")
    _two_runs_at_once(tmp_path, ("node-a", "node-b"))
