"""Train a classifier with DDP: ``torchrun --nproc_per_node=N tools/train_net.py --cfg FILE [KEY VALUE ...]``.

Also runs as a plain process (``python tools/train_net.py``), under ``srun`` or ``mpirun``, or
starts N local workers itself with ``--nproc N``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.cli import run_tool  # noqa: E402
from distribuuuu.trainer import train_model  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_tool(train_model, description=__doc__))
