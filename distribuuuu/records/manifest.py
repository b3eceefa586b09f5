"""What each start of a run records: its merged config and a manifest of the code, versions and machines.

OUT_DIR/config.yaml (CFG_DEST) is the config of the latest start; OUT_DIR/starts/NNN_<time>/
keeps every start's config.yaml and manifest.json, so a resumed run's record says what trained
each part of it and on what.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

import torch
import torchvision

from distribuuuu.records.set_aside import numbered_folder
from distribuuuu.records.starts import MANIFEST_FILE, STARTS_DIR
from distribuuuu.runtime.launcher import DistEnv


def record_start(
    out_dir: str, config_yaml: str, cfg_dest: str, env: DistEnv, table: list[dict], resumed_from: str | None
) -> str:
    """Write OUT_DIR/``cfg_dest`` (the merged config, ``config_yaml``) and a new OUT_DIR/starts/NNN_<time>/
    with the config and manifest (rank 0)."""
    folder = numbered_folder(os.path.join(out_dir, STARTS_DIR))
    for where in (out_dir, folder):
        with open(os.path.join(where, cfg_dest), "w") as f:
            f.write(config_yaml)
    with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
        json.dump(manifest(env, table, resumed_from), f, indent=2)
    return folder


def manifest(env: DistEnv, table: list[dict], resumed_from: str | None) -> dict:
    """The code, the versions and the machines of this start."""
    return {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "resumed_from": resumed_from,
        "git": git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "nccl": _nccl_version(),
        "device": device_name(env.device),
        "world_size": env.world_size,
        "launcher": env.launcher,
        "hosts": sorted({row["host"] for row in table}),
    }


def git_state() -> dict | None:
    """The git commit of the distribuuuu code that runs (and whether it has uncommitted changes), if any."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an installed wheel), or no git
        return None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":  # GPU seam
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
