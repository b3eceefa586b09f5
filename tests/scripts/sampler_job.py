"""A 2-process job that records the sample keys the training sampler of a real config gives each rank.

    torchrun --nproc_per_node=2 tests/scripts/sampler_job.py KEY VALUE ...

The train split is built by build_train_split from the config, as training builds it; each rank
records its ``(round, index)`` keys for epochs 0 and 1, and for epoch 1 resumed after 5 samples.
Rank 0 prints every rank's keys as one JSON line.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distribuuuu import utils  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402
from distribuuuu.data import build_train_split  # noqa: E402

RESUME_AT = 5


def main(opts: list[str]) -> None:
    env = utils.setup_distributed()
    split = build_train_split(load_cfg(opts=opts), env)
    keys = {}
    for epoch in (0, 1):
        split.sampler.set_epoch(epoch)
        split.sampler.set_start(0)
        keys[str(epoch)] = list(split.sampler)
    resumed = build_train_split(load_cfg(opts=opts), env).sampler  # built anew, as after a restart
    resumed.set_epoch(1)
    resumed.set_start(RESUME_AT)
    keys["resumed"] = list(resumed)
    gathered = utils.all_gather_object(keys)
    if env.rank == 0:
        sys.stdout.write("KEYS " + json.dumps(gathered) + "\n")
    utils.cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
