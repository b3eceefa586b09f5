"""The docs' distribuuuu.utils example, run as written under torchrun with two processes. The launch of
tests/unit/test_docs.py."""

from __future__ import annotations

import re

import pytest
from docs_helpers import _pages
from helpers import assert_ok, run_torchrun

from distribuuuu.checkpointing.checkpoint import load_checkpoint


@pytest.mark.slow
def test_the_docs_utils_example_runs_under_torchrun_with_two_processes(tmp_path):
    examples = [
        block
        for page in _pages()
        for block in re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)
        if "from distribuuuu import utils" in block
    ]
    [example] = examples
    script = tmp_path / "example.py"
    script.write_text(example)
    result = run_torchrun(2, str(script), timeout=300, cwd=tmp_path)
    assert_ok(result)
    assert re.search(r"^2 ranks, mean loss \d+\.\d{4}$", result.stdout, flags=re.M), result.stdout
    assert "model" in load_checkpoint(str(tmp_path / "out" / "model.pth.tar"))
