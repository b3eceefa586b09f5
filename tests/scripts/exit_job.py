"""A tool's entry point in this process; as the interpreter exits, the gloo threads still running.

    torchrun --nproc_per_node=2 tests/scripts/exit_job.py TOOL [ARGS...]   (TOOL: a script of tools/)
    RANK=0 WORLD_SIZE=1 ... python tests/scripts/exit_job.py --raise     (a job that fails past its entry point)

The report is an atexit hook registered before anything else: atexit runs its hooks last in, first
out, so this one runs after the tool's own, just before the interpreter finalizes, where a gloo
thread still running can abort the process ("terminate called without an active exception").
Prints ``gloo threads at exit: [...]`` (their names) on every rank. ``--raise`` builds a DDP model
in a one-rank group and raises an error no tool catches, which Python prints and keeps
(``sys.last_traceback``) with the frames that hold the model, and through it the group.
"""

import atexit
import os
import runpy
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]


def report_gloo_threads() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    print(f"gloo threads at exit: {sorted(n for n in names if 'gloo' in n)}", flush=True)


def failing_job() -> None:
    import torch
    from torch import nn

    from distribuuuu import utils

    utils.setup_distributed()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    raise RuntimeError("a bug after the model was built")


if __name__ == "__main__":
    atexit.register(report_gloo_threads)
    if sys.argv[1] == "--raise":
        failing_job()
    import models  # noqa: F401  (registers the suite's models: MODEL.ARCH tiny_cnn)

    tool = os.path.join(os.path.dirname(_TESTS), "tools", sys.argv[1])
    sys.argv = [tool, *sys.argv[2:]]
    runpy.run_path(tool, run_name="__main__")
