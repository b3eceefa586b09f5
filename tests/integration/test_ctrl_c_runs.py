"""A tool's first import loads no torch: only a fresh interpreter shows it. The launch of
tests/unit/runtime/test_ctrl_c.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.usefixtures("plain_logging")


def test_a_tools_first_import_loads_no_torch():
    """What startup.imported needs is imported before torch: only a fresh interpreter shows it."""
    code = "import sys, distribuuuu.startup; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr[-2000:]
