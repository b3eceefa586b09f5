"""An error no tool catches, in a fresh interpreter: its traceback kept and no gloo thread left to the
exit. The launch of tests/unit/runtime/test_distributed_env.py."""

from __future__ import annotations

import os

import pytest
from helpers import REPO, clean_env, python, run

from distribuuuu.runtime.launcher import find_free_port

EXIT_JOB = str(REPO / "tests" / "scripts" / "exit_job.py")


@pytest.mark.slow  # a fresh interpreter: its exit is the property
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_an_error_no_tool_catches_keeps_its_traceback_and_leaves_no_gloo_thread_to_the_exit():
    launch = clean_env(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
    )
    result = run(python(EXIT_JOB, "--raise"), timeout=120, env=launch)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.rstrip().endswith("RuntimeError: a bug after the model was built"), result.stderr[-3000:]
    assert "terminate called" not in result.stderr and "Fatal Python error" not in result.stderr
    assert result.stdout.splitlines() == ["gloo threads at exit: []"], result.stdout
