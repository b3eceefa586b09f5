"""Train with ``trainer.train_model`` under torchrun, then print the gloo threads left in this process.

    torchrun --nproc_per_node=2 tests/scripts/teardown_job.py KEY VALUE ...

train_model destroys its process group before it returns; once nothing else holds the group, its
gloo threads have ended too. Prints ``gloo threads left: [...]`` on every rank.
"""

import os
import sys

from distribuuuu import trainer
from distribuuuu.config import load_cfg


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux names them pt_gloo_runloop, gloo_tcp_loop)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    trainer.train_model(load_cfg(None, sys.argv[1:]))
    print(f"gloo threads left: {gloo_threads()}", flush=True)
