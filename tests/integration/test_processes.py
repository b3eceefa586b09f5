"""No process a test starts outlives it: a timed-out launch is killed whole, and the session fails
when anything it started is still running at its end (tests/processes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, clean_env, run

# A process that starts a grandchild in a session of its own (as torchrun starts its workers),
# prints the grandchild's pid, and waits.
ESCAPING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_timed_out_launch_is_killed_with_what_it_started_in_other_sessions():
    with pytest.raises(AssertionError, match="did not finish in 3s") as failure:
        run([sys.executable, "-c", ESCAPING], timeout=3)
    message = str(failure.value)
    grandchild = int(message.split("stdout:\n", 1)[1].split()[0])
    assert f"pid {grandchild}: " in message and "killed 2 process(es)" in message, message
    assert _wait_gone(grandchild), f"pid {grandchild} outlived its launch"


LEAVES_ONE = """
import subprocess, sys

def test_starts_a_process_and_forgets_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print("LEFT", child.pid)
"""


def test_a_session_that_leaves_a_process_running_fails_and_names_it(tmp_path):
    (tmp_path / "test_leaves_one.py").write_text(LEAVES_ONE)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]), PYTEST_ADDOPTS="")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "processes",
        "-p",
        "no:cacheprovider",
        "test_leaves_one.py",
    ]
    inner = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    left = int(inner.stdout.split("LEFT ", 1)[1].split()[0])
    assert inner.returncode == 1, inner.stdout + inner.stderr
    assert "1 passed" in inner.stdout
    assert "1 process(es) started by the tests outlived them (killed now):" in inner.stderr
    assert f"pid {left}: " in inner.stderr and "time.sleep(300)" in inner.stderr
    assert _wait_gone(left), f"pid {left} is still running"


HANGS = """
import subprocess, sys, time

def test_starts_a_process_and_hangs():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print("LEFT", child.pid, flush=True)
    time.sleep(300)
"""


def test_a_session_stopped_by_sigterm_still_kills_and_names_what_its_tests_started(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]), PYTEST_ADDOPTS="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "processes", "-p", "no:cacheprovider", "test_hangs.py"]
    inner = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "LEFT" not in line:
            line = inner.stdout.readline()
            assert line, "the inner session ended before its test started a process"
        left = int(line.split("LEFT ", 1)[1].split()[0])
        inner.send_signal(signal.SIGTERM)
        out, err = inner.communicate(timeout=60)
    finally:
        inner.kill()
    assert inner.returncode != 0
    assert f"pid {left}: " in err and "outlived them (killed now)" in err, out + err
    assert _wait_gone(left), f"pid {left} is still running"
