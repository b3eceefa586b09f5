"""tests/zygote.py: a launch forked from the preloaded server is the process a fresh interpreter is."""

from __future__ import annotations

import sys

import pytest
import zygote
from helpers import clean_env, python, run, torchrun

# One single-threaded process at a time (or two torchrun workers that sleep): beside the background jobs.
pytestmark = pytest.mark.one_core

# What a process can see of how it was started, then an ending chosen by its first argument.
# "forked": its environment at exec time (/proc) is not the one it runs with.
PROBE = """
import atexit, concurrent.futures, os, signal, sys, threading, time
import torch

atexit.register(lambda: print("atexit ran", flush=True))
# Each line is printed in a fixed order, so forked and fresh outputs compare line for line.
printed = threading.Event()
threading.Thread(target=lambda: (printed.wait(), print("thread joined")), daemon=False).start()
# An idle pool thread, as torch.compile leaves: threading's exit hook must end it, or exit hangs.
concurrent.futures.ThreadPoolExecutor(1).submit(print, "pool ran").result()
forked = b"PROBE_VAR=seen" not in open("/proc/self/environ", "rb").read().split(b"\\0")
print("forked", forked, file=sys.stderr)
print("argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("cwd", os.getcwd(), "env", os.environ.get("PROBE_VAR"), "threads", torch.get_num_threads())
print("main", __name__, "stdin", sys.stdin.read(), "sigpipe", signal.getsignal(signal.SIGPIPE))
how = sys.argv[1]
if how == "sigterm":
    # Under torchrun, each worker waits until every worker has printed: the agent ends the others
    # when the first one dies, and a loaded machine may not have let them print yet.
    open(f"printed.{os.environ.get('LOCAL_RANK', 0)}", "w").close()
    workers = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for _ in range(600):
        if all(os.path.exists(f"printed.{r}") for r in range(workers)):
            break
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
printed.set()
if how == "raise":
    raise ValueError("boom")
sys.exit(int(how) if how.isdigit() else how)
"""

needs_fork = pytest.mark.skipif(not zygote.ENABLED, reason="DISTRIBUUUU_TEST_FORK=0: every launch is fresh")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return str(path)


@needs_fork
@pytest.mark.parametrize("how", ["0", "3", "a message", "raise", "sigterm"])
def test_a_forked_launch_sees_and_ends_as_a_fresh_interpreter(probe, tmp_path, how):
    env = clean_env(PROBE_VAR="seen", OMP_NUM_THREADS="1")
    forked, fresh = (run(python(probe, how, "x y"), env=env, cwd=tmp_path, fresh=f, timeout=60) for f in (False, True))
    assert "forked True" in forked.stderr and "forked False" in fresh.stderr
    assert forked.returncode == fresh.returncode == {"0": 0, "3": 3, "sigterm": -15}.get(how, 1)
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    assert f"cwd {tmp_path} env seen threads 1" in forked.stdout
    if how in ("0", "3", "a message"):  # the interpreter's exit path: pool and threads joined, atexit run
        assert all(line in forked.stdout for line in ("pool ran", "thread joined", "atexit ran")), forked.stdout
    if how == "raise":
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: boom"
    else:
        assert forked.stderr.replace("forked True", "forked False") == fresh.stderr


@needs_fork
def test_a_launch_whose_start_up_environment_differs_runs_fresh(probe, tmp_path):
    """torch reads TORCH_* variables on import: a fork would keep the server's; the launch runs fresh."""
    result = run(python(probe, "0"), env=clean_env(PROBE_VAR="seen", TORCH_SHOW_CPP_STACKTRACES="1"), cwd=tmp_path)
    assert result.returncode == 0 and "forked False" in result.stderr, result.stderr


@needs_fork
def test_torchrun_workers_forked_through_the_client_exit_and_are_signalled_as_fresh_ones(probe, tmp_path):
    forked = run(torchrun(2, probe, "sigterm"), env=clean_env(PROBE_VAR="seen"), cwd=tmp_path, timeout=120)
    assert forked.stderr.count("forked True") == 2, forked.stderr
    assert forked.returncode == 1 and "exitcode  : -15 (pid:" in forked.stderr, forked.stderr
    assert forked.stdout.count("atexit ran") == 0 and "Signal 15 (SIGTERM) received by PID" in forked.stderr
    ok = run(torchrun(2, probe, "0"), env=clean_env(PROBE_VAR="seen"), cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and ok.stdout.count("atexit ran") == 2 and ok.stdout.count("thread joined") == 2


def test_a_torchrun_worker_client_without_a_server_becomes_the_worker(probe, tmp_path):
    """Launched other than through helpers.run (as test_faults's jobs are), the workers are fresh
    interpreters whose pids torchrun knows."""
    import subprocess

    env = clean_env(PROBE_VAR="seen")
    done = subprocess.run(torchrun(2, probe, "0"), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.count("forked False") == 2, done.stderr


def test_forkable_takes_only_this_interpreter_running_a_script_or_a_module():
    assert zygote.forkable([sys.executable, "tools/train_net.py", "--cfg", "x.yaml"]) == zygote.ENABLED
    assert zygote.forkable([sys.executable, "-m", "torch.distributed.run", "x.py"]) == zygote.ENABLED
    assert not zygote.forkable([sys.executable, "-c", "print(1)"])
    assert not zygote.forkable(["bash", "x.sh"])


BROKEN_SERVER = """
import sys
import helpers, zygote

assert zygote.address() == "", "the server imported a torchvision that cannot be imported"
result = helpers.run(helpers.python(sys.argv[1]), env=helpers.clean_env(PYTHONPATH=""))
print("launch", result.returncode, result.stdout.strip())
print("account", zygote.stop().strip().splitlines()[-1])
"""


@needs_fork
def test_a_server_that_cannot_start_leaves_every_launch_to_run_fresh(tmp_path):
    """A preloaded module that fails to import (here a torchvision that raises) stops the server,
    not the tests: each launch then starts a fresh interpreter, and the session's account says so."""
    import os
    import subprocess

    from helpers import REPO

    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "torchvision.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp_path / "main.py").write_text(BROKEN_SERVER)
    (tmp_path / "hello.py").write_text("print('hello')\n")
    path = os.pathsep.join([str(tmp_path / "fake"), str(REPO / "tests"), str(REPO)])
    done = subprocess.run(
        [sys.executable, str(tmp_path / "main.py"), str(tmp_path / "hello.py")],
        env=clean_env(PYTHONPATH=path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "launch 0 hello" in done.stdout
    assert "account the server did not start (exit 1); every launch runs fresh" in done.stdout, done.stdout
