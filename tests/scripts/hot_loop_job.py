"""One rank of test_hot_loop_runs.py's two-process job: record an epoch per precision and write what was called.

torchrun --nproc_per_node=2 tests/scripts/hot_loop_job.py OUT_DIR PRECISION...
"""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

from hot_loop_helpers import _worker  # noqa: E402

if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
