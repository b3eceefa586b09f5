"""The docs stay true: every config key documented, every page reachable, links resolve, examples run
(the utils example under torchrun: tests/integration/test_docs_runs.py)."""

from __future__ import annotations

import json
import re
import sys

from docs_helpers import DOCS, README, _pages
from helpers import REPO

from distribuuuu import utils
from distribuuuu.config import flatten, get_cfg_defaults

sys.path.insert(0, str(REPO / "tools"))
import config_reference  # noqa: E402

CONFIG_REFERENCE = DOCS / "config-reference.md"
# Markdown links and images: [text](target) / ![alt](target); the target ends at ")" or a title.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M)


def _without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_config_reference_documents_every_config_key():
    page = CONFIG_REFERENCE.read_text()
    missing = [k for k in flatten(get_cfg_defaults()) if f"`{k}`" not in page]
    assert not missing, f"{CONFIG_REFERENCE.name} lacks these config keys (run tools/config_reference.py): {missing}"
    # Defaults and comments too: the page holds the generated table verbatim.
    assert config_reference.reference_table() in page, f"{CONFIG_REFERENCE.name} is stale: regenerate its table"


def test_the_readmes_second_bash_block_is_the_test_command_that_ci_runs():
    # .ci/run executes the README's second ```bash block; the first is install + train.
    blocks = _bash_blocks(README.read_text())
    assert len(blocks) >= 2 and "tools/train_net.py" in blocks[0] and "pytest" in blocks[1], blocks[:2]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target.split("#")[0] for target in _LINK.findall(_without_code(README.read_text()))}
    unlinked = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlinked, f"README.md links none of these pages: {unlinked}"


def test_every_relative_link_in_the_readme_and_docs_points_to_an_existing_file_and_heading():
    broken = []
    for page in _pages():
        for target in _LINK.findall(_without_code(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_utils_toolbox_page_names_every_public_name_of_distribuuuu_utils():
    page = (DOCS / "development.md").read_text()
    missing = [name for name in utils.__all__ if f"`{name}`" not in page]
    assert not missing, f"docs/development.md does not list these names of distribuuuu.utils: {missing}"


def _section(text: str, heading: str) -> str:
    """The README's text under ``## heading``, up to the next ``## `` heading."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


_TORCH_PAIR = r"torch (\d+\.\d+\.\d+) / torchvision (\d+\.\d+\.\d+)"


def test_the_readmes_accuracy_figures_name_their_torch_and_torchvision_versions():
    # The Quick start states what to expect and points here for the measured figures.
    section = _section(README.read_text(), "Accuracy on the embedded dataset")
    assert re.search(_TORCH_PAIR, section), (
        "README.md's accuracy figures do not say which torch / torchvision gave them"
    )


def test_every_torch_and_torchvision_version_the_docs_name_for_a_figure_is_one_requirements_allow():
    from packaging.requirements import Requirement

    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    requirements = map(
        Requirement, (line for line in lines if line and not line.startswith("#"))
    )  # as setup.py reads it
    wanted = {r.name: r.specifier for r in requirements if r.name in ("torch", "torchvision")}
    outside = [
        f"{page.relative_to(REPO)}: torch {torch_version} / torchvision {torchvision_version}"
        for page in _pages()
        for torch_version, torchvision_version in re.findall(_TORCH_PAIR, page.read_text())
        if not (wanted["torch"].contains(torch_version) and wanted["torchvision"].contains(torchvision_version))
    ]
    assert not outside, f"figures measured outside requirements.txt's {wanted}: {outside}"


def test_every_file_and_readme_section_a_config_comment_names_exists():
    readme_headings = set(re.findall(r"^#+ (.+)$", README.read_text(), flags=re.M))
    missing = []
    for config in sorted((REPO / "config").rglob("*.yaml")):
        comments = "\n".join(line for line in config.read_text().splitlines() if line.lstrip().startswith("#"))
        for path in re.findall(r"\b((?:config|docs|tools|data)/[\w./-]*\w\.(?:yaml|md|py|sh))\b", comments):
            if not (REPO / path).is_file():
                missing.append(f"{config.name}: {path}")
        for heading in re.findall(r'README section "([^"]+)"', comments):
            if heading not in readme_headings:
                missing.append(f'{config.name}: README section "{heading}"')
    assert not missing, missing


def test_a_summary_without_matplotlib_gives_the_readmes_install_command(tmp_path, monkeypatch):
    from distribuuuu.records import summary

    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(summary, "save_plot", no_matplotlib)
    record = {"epoch": 1, "loss": 1.0, "top1": 50.0, "topk": 90.0, "k": 5, "time_s": 1.0, "samples": 10}
    lines = [{**record, "split": "train", "lr": 0.1, "images_per_s": 10.0}, {**record, "split": "val"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    [plot_line] = [line for line in summary.write_summary(str(tmp_path)).splitlines() if line.startswith("- plot:")]
    command = re.fullmatch(r"- plot: none \((pip install .+)\)", plot_line)
    assert command and command.group(1) in README.read_text(), f"{plot_line!r}: not the README's install command"
    assert not (tmp_path / "metrics.png").exists()
