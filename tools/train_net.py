"""Train a classifier with DDP: ``torchrun --nproc_per_node=N tools/train_net.py --cfg FILE [KEY VALUE ...]``.

Also runs as a plain process (``python tools/train_net.py``), under ``srun`` or ``mpirun``, or
starts N local workers itself with ``--nproc N``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.startup import imported  # noqa: E402  (before torch: a Ctrl-C while it loads is one line)

if __name__ == "__main__":
    run_tool = imported("distribuuuu.cli", "run_tool")
    sys.exit(run_tool(imported("distribuuuu.trainer", "train_model"), description=__doc__))
