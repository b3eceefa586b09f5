"""Nothing a test starts outlives it: every process the test session starts is tagged, and found by its tag.

An environment variable marks every process the tests start and every process those start, whatever
session they move to (torchrun's workers lead their own, which a process-group kill misses). Each
launch adds a tag of its own, killed whole on a timeout; the session's tag finds what is left at its
end, and fails the run. A pytest plugin (``tests/conftest.py`` imports its hooks).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass

SESSION_VAR = "DISTRIBUUUU_TEST_SESSION"  # every process of the test session
LAUNCH_VAR = "DISTRIBUUUU_TEST_LAUNCH"  # every process of one launch (helpers.Started)
_launches = itertools.count()


@dataclass(frozen=True)
class Process:
    pid: int
    cmdline: str
    ppid: int = 0
    environ: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.cmdline[:300]}"


def new_launch_tag() -> str:
    return f"{os.environ.get(SESSION_VAR, os.getpid())}-{next(_launches)}"


def tagged(var: str, value: str) -> list[Process]:
    """The live processes (not zombies) whose environment has ``var=value``, this one excepted."""
    entry, found = f"{var}={value}".encode(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            if entry not in environ or state == b"Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(Process(int(name), cmdline, int(ppid), tuple(v.decode(errors="replace") for v in environ if v)))
    return found


def kill_tagged(var: str, value: str, wait_s: float = 10) -> list[Process]:
    """SIGKILL every process tagged ``var=value`` until none is left: the ones found alive."""
    first = tagged(var, value)
    found, deadline = first, time.monotonic() + wait_s
    while found and time.monotonic() < deadline:
        for process in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        time.sleep(0.05)
        found = tagged(var, value)
    return first


# The pytest hooks ---------------------------------------------------------------------------------
def pytest_configure(config) -> None:
    # A session started by another session's test tags its own processes, not the outer one's.
    os.environ[SESSION_VAR] = uuid.uuid4().hex
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A session stopped from outside (a CI timeout) ends as on Ctrl-C: fixtures torn down, the
        # processes found and killed below, instead of dying at once and leaving them running.
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionfinish(session, exitstatus) -> None:
    """No process outlives the tests: anything the tests started and left fails the session."""
    left = kill_tagged(SESSION_VAR, os.environ[SESSION_VAR])
    if left:
        lines = [f"{len(left)} process(es) started by the tests outlived them (killed now):", *map(str, left)]
        print("\n" + "\n".join(lines), file=sys.stderr, flush=True)
        session.exitstatus = 1
