"""OUT_DIR/starts/ read back: each start of a run (its number, when, and what it resumed from), for
the run's summary. ``manifest.py`` writes them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

STARTS_DIR = "starts"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Start:
    """One start of a run: its folder's number, its manifest's time, the checkpoint it resumed (None: a new run)."""

    number: str
    time: str
    resumed_from: str | None

    def describe(self) -> str:
        what = f"resumed from {self.resumed_from}" if self.resumed_from else "a new run"
        return f"{self.number} at {self.time}: {what}"


def read_starts(out_dir: str) -> list[Start]:
    """The starts OUT_DIR/starts/ records, in order; a folder without a readable manifest is left out."""
    folder = os.path.join(out_dir, STARTS_DIR)
    names = sorted(n for n in os.listdir(folder) if n[:3].isdigit()) if os.path.isdir(folder) else []
    starts = []
    for name in names:
        try:
            with open(os.path.join(folder, name, MANIFEST_FILE)) as f:
                manifest = json.load(f)
        except (OSError, ValueError):  # a start killed while writing it: the others still say what they were
            continue
        if isinstance(manifest, dict):
            starts.append(Start(name[:3], str(manifest.get("time", "?")), manifest.get("resumed_from")))
    return starts
