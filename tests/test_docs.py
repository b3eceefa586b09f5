"""The README stays true: every config key documented, CI runs its test command, examples exist."""

from __future__ import annotations

import re
import sys

from helpers import REPO, assert_ok, run, torchrun

from distribuuuu.checkpoint import load_checkpoint
from distribuuuu.config import get_cfg_defaults

sys.path.insert(0, str(REPO / "tools"))
import config_reference  # noqa: E402


def _flat_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        keys += _flat_keys(value, key + ".") if hasattr(value, "items") else [key]
    return keys


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_documents_every_config_key():
    readme = (REPO / "README.md").read_text()
    missing = [k for k in _flat_keys(get_cfg_defaults()) if f"`{k}`" not in readme]
    assert not missing, f"README lacks these config keys (run tools/config_reference.py): {missing}"
    # Defaults and comments too: the README holds the generated table verbatim.
    assert config_reference.reference_table() in readme, "README's config reference is stale: regenerate it"


def test_readme_opens_with_the_install_and_train_then_install_and_test_commands():
    train_cmd, test_cmd = _bash_blocks((REPO / "README.md").read_text())[:2]
    assert "pip install -e ." in train_cmd and "torchrun --nproc_per_node=2 tools/train_net.py" in train_cmd
    assert 'pip install -e ".[test]"' in test_cmd and "pytest" in test_cmd


def test_ci_runs_the_readmes_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert "README.md" in ci and "n==2" in ci, ".ci/run must execute the README's second bash block"


def test_the_readmes_utils_example_runs_under_torchrun_with_two_processes(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(), flags=re.S | re.M)
    [example] = [b for b in blocks if "from distribuuuu import utils" in b]
    script = tmp_path / "example.py"
    script.write_text(example)
    result = run(torchrun(2, str(script)), timeout=300, cwd=tmp_path)
    assert_ok(result)
    assert re.search(r"^2 ranks, mean loss \d+\.\d{4}$", result.stdout, flags=re.M), result.stdout
    assert "model" in load_checkpoint(str(tmp_path / "out" / "model.pth.tar"))
