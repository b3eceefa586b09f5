"""Evaluate a checkpoint: ``torchrun --nproc_per_node=N tools/test_net.py [--cfg FILE] MODEL.WEIGHTS PATH``.

The config is the checkpoint's own (the keys its run trained with, not its runtime keys such as
OUT_DIR), under ``--cfg FILE`` and then the trailing ``KEY VALUE`` pairs. Prints top-1/top-k on
the val split and appends a ``"split": "test"`` line to OUT_DIR/metrics.jsonl.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.startup import imported  # noqa: E402  (before torch: a Ctrl-C while it loads is one line)

if __name__ == "__main__":
    run_tool = imported("distribuuuu.cli", "run_tool")
    test_model = imported("distribuuuu.training.evaluation", "test_model")
    evaluation_cfg = imported("distribuuuu.training.stored_config", "evaluation_cfg")
    sys.exit(run_tool(test_model, description=__doc__, build_cfg=evaluation_cfg))
