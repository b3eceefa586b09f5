"""Every tool's ways out of a bad command line, each tool's ``__main__`` in this process: argparse's
usage and one error line, exit 2, no traceback, nothing on stdout.

How the tools end otherwise (success, bad input, Ctrl-C, a failed rank) is tested beside each tool;
that no process group outlives one is tests/unit/runtime/test_distributed_env.py's ("Ending the process group").
"""

from __future__ import annotations

import pytest
from helpers import REPO, in_process

TOOLS = REPO / "tools"
# Each tool's command line with an option left without its value (a tool with no such option: its
# arguments left out, or one too many).
MISSING_VALUE = {
    "avg_checkpoints.py": ["output", "--last", "2", "-o"],
    "benchmark.py": ["--steps"],
    "config_reference.py": ["--write", "now"],
    "convert_checkpoint.py": [],
    "export.py": ["--weights"],
    "gpu_check.py": ["--device"],
    "make_digit_pairs.py": ["out", "--src"],
    "pack_dataset.py": ["data/digits", "out", "--shard-size"],
    "plot_metrics.py": ["output", "-o"],
    "predict.py": ["data/digits/val", "--weights"],
    "summarize.py": [],
    "test_net.py": ["--cfg"],
    "train_net.py": ["--cfg"],
}


def test_the_table_names_every_tool():
    assert sorted(MISSING_VALUE) == sorted(path.name for path in TOOLS.glob("*.py"))


@pytest.mark.parametrize("case", ["unknown flag", "missing value"])
@pytest.mark.parametrize("tool", sorted(MISSING_VALUE))
def test_a_bad_command_line_is_the_usage_and_one_error_line_with_exit_2(tool, case):
    args = ["--bogus-flag"] if case == "unknown flag" else MISSING_VALUE[tool]
    result = in_process(str(TOOLS / tool), *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "", "nothing but argparse's lines"
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines[0].startswith(f"usage: {tool} "), result.stderr
    assert all(line.startswith(" ") for line in lines[1:-1]), f"only the usage, wrapped, before the error: {lines}"
    assert lines[-1].startswith(f"{tool}: error: "), result.stderr
    if case == "unknown flag":
        assert "--bogus-flag" in lines[-1] or "required" in lines[-1], lines[-1]


def test_make_digit_pairs_without_digits_under_src_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "src" / "train" / "3").mkdir(parents=True)  # a class folder without images
    out = tmp_path / "pairs"
    result = in_process(str(TOOLS / "make_digit_pairs.py"), str(out), "--src", str(tmp_path / "src"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"make_digit_pairs.py: error: no PNG digits in {tmp_path / 'src' / 'train'}/<class>/ "
        "(--src: an ImageFolder root such as data/digits)"
    ]
    assert not out.exists()
    missing = in_process(str(TOOLS / "make_digit_pairs.py"), str(out), "--src", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1, missing.stderr
    assert str(tmp_path / "nowhere") in missing.stderr and "Traceback" not in missing.stderr
