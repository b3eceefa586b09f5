"""Ctrl-C in this process: a second Ctrl-C stops at once (one within a second is the same press), one
while torch loads is one line from rank 0 and exit 130, one during a tool's first import is held to its
end unless ignored. (That first import loads no torch: tests/integration/test_ctrl_c_runs.py.)"""

from __future__ import annotations

import logging
import signal
import sys
import types

import pytest
from helpers import REPO, clean_env, in_process

from distribuuuu import cli, startup
from distribuuuu.runtime import preemption
from distribuuuu.runtime.preemption import PreemptionHandler

pytestmark = pytest.mark.usefixtures("plain_logging")


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_second_ctrl_c_stops_at_once_and_one_within_a_second_is_the_same_one(monkeypatch, capsys):
    clock, exits = [100.0], []
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(preemption.os, "_exit", lambda code: exits.append(code))
    with PreemptionHandler(grace_s=60) as handler:
        signal.raise_signal(signal.SIGINT)
        assert handler.requested and handler.interrupted and not exits
        clock[0] += 0.5  # the terminal's Ctrl-C and the launcher's copy of it
        signal.raise_signal(signal.SIGINT)
        assert not exits
        clock[0] += 2.0
        signal.raise_signal(signal.SIGINT)
        assert exits == [130]
        handler._timer.cancel()
    assert "second Ctrl-C: stopped at once, without a checkpoint" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) == handler._handle, "after the stop, Ctrl-C still reaches the handler"


class _Loading(types.ModuleType):
    """A module still loading when Ctrl-C comes: a SIGINT arrives as each name is read, ``apart_s``
    after the previous one on ``clock``; what the SIGINT handler was then is kept in ``handlers``."""

    def __init__(self, name: str, presses: int = 1, clock: list | None = None, apart_s: float = 0.0):
        super().__init__(name)
        self.presses, self.clock, self.apart_s, self.handlers = presses, clock or [0.0], apart_s, []

    def __getattr__(self, name: str):
        if name.startswith("__"):  # what tools such as inspect ask of any module: not a name being imported
            raise AttributeError(name)
        for _ in range(self.presses):
            signal.raise_signal(signal.SIGINT)
            self.handlers.append(signal.getsignal(signal.SIGINT))
            self.clock[0] += self.apart_s
        return getattr(cli, name)


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("tool", ["train_net.py", "test_net.py"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_ctrl_c_while_torch_loads_is_one_line_from_rank_0_and_exit_130(monkeypatch, tool, rank):
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", _Loading("distribuuuu.cli"))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's process (not nohup's)
    env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_PORT="29500")
    result = in_process(str(REPO / "tools" / tool), env=env)
    assert (result.returncode, result.stdout) == (130, "")
    said = ["distribuuuu: interrupted (Ctrl-C) while starting; nothing saved"] if rank == 0 else []
    assert result.stderr.splitlines() == said


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("before", ["a terminal's default", "ignored (nohup)"])
def test_a_ctrl_c_during_the_import_is_held_to_its_end_unless_it_is_ignored(monkeypatch, before):
    handler = signal.default_int_handler if before == "a terminal's default" else signal.SIG_IGN
    loading = _Loading("distribuuuu.cli")
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", loading)
    signal.signal(signal.SIGINT, handler)
    if handler is signal.SIG_IGN:
        assert startup.imported("distribuuuu.cli", "run_tool") is cli.run_tool  # as if nothing was pressed
    else:
        with pytest.raises(SystemExit) as stopped:
            startup.imported("distribuuuu.cli", "run_tool")
        assert stopped.value.code == 130
        assert loading.handlers[0] not in (signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL), "held"
    assert signal.getsignal(signal.SIGINT) is handler, "put back after the import"


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_second_ctrl_c_stops_an_import_that_hangs(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(startup.time, "monotonic", lambda: clock[0])
    loading = _Loading("distribuuuu.cli", presses=3, clock=clock, apart_s=0.6)  # at 100, 100.6: one Ctrl-C
    monkeypatch.setitem(sys.modules, "distribuuuu.cli", loading)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):  # the third, at 101.2 s: more than a second after the first
        startup.imported("distribuuuu.cli", "run_tool")
    assert len(loading.handlers) == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_started_with_ctrl_c_ignored_keeps_ignoring_it_and_says_so(own_signal_handlers, caplog):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup or a shell's & start it
    with caplog.at_level(logging.INFO, logger="distribuuuu"), PreemptionHandler(grace_s=60):
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    said = [r.getMessage() for r in caplog.records if "SIGINT" in r.getMessage()]
    assert len(said) == 1 and "is ignored by this process" in said[0] and "SIGTERM" in said[0]
