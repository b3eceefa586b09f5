"""Run the ``distribuuuu.utils`` example (utils_job.py) under torchrun, then train with
``trainer.train_model`` in the same process group, then print the gloo threads left in this process.

    torchrun --nproc_per_node=2 tests/scripts/teardown_job.py UTILS_OUT_DIR KEY VALUE ...

One launch for both: train_model takes the group already set up (setup_distributed returns at once)
and destroys it before it returns; once nothing else holds the group, its gloo threads have ended
too. Prints utils_job's ``OK rank=...`` line and ``gloo threads left: [...]`` on every rank.
(Setting up a second group in one torchrun process after destroying the first hangs: hence one group.)
"""

import os
import sys

import utils_job

from distribuuuu import trainer, utils
from distribuuuu.config import load_cfg


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux names them pt_gloo_runloop, gloo_tcp_loop)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    utils_job.train_and_save(utils.setup_distributed(), sys.argv[1])
    trainer.train_model(load_cfg(None, sys.argv[2:]))
    print(f"gloo threads left: {gloo_threads()}", flush=True)
