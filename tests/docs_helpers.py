"""The pages the docs tests read (README.md and docs/*.md), in unit and integration alike."""

from __future__ import annotations

from helpers import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def _pages() -> list:
    return [README, *sorted(DOCS.glob("*.md"))]
