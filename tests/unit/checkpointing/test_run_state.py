"""A run's state defined once: a component registered on a run is saved and resumed in both formats;
one ordering of checkpoint names for every lister and pruner; no import circle among the checkpoint modules."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from helpers import REPO
from torch import nn

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import load_cfg
from distribuuuu.models import register_model
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training import convert
from distribuuuu.training import resume as state
from distribuuuu.training import run as run_setup
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.state import Run


@register_model("run_state_cnn")
def run_state_cnn(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))


class Counter:
    """A piece of state the package knows nothing of: torch's Stateful protocol, nothing more."""

    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.count = state_dict["count"]


def _run(out: Path, fmt: str, seed: int, arch: str = "run_state_cnn") -> Run:
    torch.manual_seed(seed)
    opts = ["MODEL.ARCH", arch, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.WORKERS", "0"]
    opts += ["OPTIM.EMA_DECAY", "0.9", "DIST.CKPT_FORMAT", fmt, "OUT_DIR", str(out)]
    return run_setup.build_run(load_cfg(None, opts), DistEnv())


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_component_registered_on_a_run_comes_back_from_either_format(tmp_path, fmt):
    saved = _run(tmp_path, fmt, seed=0)
    saved.registered_state["counter"] = Counter(7)
    saved.state.epoch, saved.state.step_in_epoch = 1, 3
    path = state.save_training_checkpoint(saved, state.checkpointer(saved.cfg))
    assert os.path.isdir(path) == (fmt == "sharded")
    assert ckpt.load_checkpoint(path)["counter"] == {"count": 7}, "the tools see it too, as a flat key"

    resumed = _run(tmp_path, fmt, seed=1)  # other initial weights: what comes back is the checkpoint's
    resumed.registered_state["counter"] = Counter()
    state.resume_or_load_weights(resumed, state.checkpointer(resumed.cfg), path)
    assert resumed.registered_state["counter"].count == 7
    assert (resumed.state.epoch, resumed.state.step_in_epoch) == (1, 3)
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    for name, tensor in saved.ema.module.state_dict().items():
        assert torch.equal(resumed.ema.module.state_dict()[name], tensor), name


def test_a_checkpoint_written_before_a_component_was_registered_still_resumes(tmp_path):
    saved = _run(tmp_path, "file", seed=0)
    path = state.save_training_checkpoint(saved, state.checkpointer(saved.cfg))
    resumed = _run(tmp_path, "file", seed=1)
    resumed.registered_state["counter"] = Counter(5)
    state.resume_or_load_weights(resumed, state.checkpointer(resumed.cfg), path)
    assert resumed.registered_state["counter"].count == 5, "nothing saved: the component keeps its own"


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_model_that_reads_its_module_versions_on_load_resumes_loads_and_converts(tmp_path, fmt):
    """torchvision's MNASNet refuses load_state_dict without the module versions that state_dict()
    records (``_metadata``): resuming, MODEL.WEIGHTS (test_net, predict, export, fine-tuning) and
    a conversion to the other format each load it, from the format that keeps them (a file) and
    from the one that does not (DCP)."""
    saved = _run(tmp_path, fmt, seed=0, arch="mnasnet0_5")
    with torch.no_grad():  # EMA weights unlike the raw ones: each load below must pick its kind
        for p in saved.ema.module.parameters():
            p.add_(1.0)
    path = state.save_training_checkpoint(saved, state.checkpointer(saved.cfg))
    resumed = _run(tmp_path / "resumed", fmt, seed=1, arch="mnasnet0_5")
    state.resume_or_load_weights(resumed, state.checkpointer(resumed.cfg), path)
    _assert_same_weights(resumed.model, saved.model)
    _assert_same_weights(resumed.ema.module, saved.ema.module)

    other = str(tmp_path / ("converted.dcp" if fmt == "file" else "converted.pth.tar"))
    if fmt == "file":
        convert.from_single_file(path, other, build_configured_model(saved.cfg.MODEL), None)
    else:
        convert.to_single_file(path, other)
    # As a DDP model's state_dict() from elsewhere (the original Distribuuuu's checkpoints): every
    # key and module version under "module.".
    wrapper = nn.Module()
    wrapper.module = saved.model
    ddp_style = str(tmp_path / "ddp_style.pth")
    torch.save({"state_dict": wrapper.state_dict()}, ddp_style)
    fresh = build_configured_model(saved.cfg.MODEL)
    state.load_weights(fresh, ddp_style, arch="mnasnet0_5")
    _assert_same_weights(fresh, saved.model)
    for source in (path, other):
        for kind, expected in (("model", saved.model), ("ema", saved.ema.module)):
            fresh = build_configured_model(saved.cfg.MODEL)
            state.load_weights(fresh, source, kind, arch="mnasnet0_5")
            _assert_same_weights(fresh, expected)


def _assert_same_weights(model: nn.Module, expected: nn.Module) -> None:
    own = model.state_dict()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(own[name], tensor), name


# What evaluation, prediction, export and fine-tuning read of the best weights: no optimizer, RNG or position.
BEST_KEYS = {"model", "ema", "epoch", "best_acc1", "best_weights", "classes", "arch", "cfg", "preprocessing"}
BEST_KEYS |= {"best_metric", "best_value"}  # TRAIN.BEST_METRIC and the best's value of it


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_the_best_weights_hold_what_the_tools_read_and_no_training_state(tmp_path, fmt):
    run = _run(tmp_path, fmt, seed=0)
    state.save_training_checkpoint(run, state.checkpointer(run.cfg), is_best=True)
    best = ckpt.load_checkpoint(str(tmp_path / (ckpt.BEST_NAME if fmt == "file" else ckpt.BEST_SHARDED)))
    assert set(best) - {"checksum", "optimizer"} == BEST_KEYS and best.get("optimizer") is None
    assert best["classes"] == run.train.classes and best["cfg"] == run.cfg.dump()


def _expected_order(names: list[str]) -> list[str]:
    """Epoch by epoch; within an epoch the steps in order, and the epoch's end after all of them."""

    def key(name: str) -> tuple[int, float]:
        stem = name.removesuffix(".pth.tar").removesuffix(".dcp").removeprefix("ckpt_ep_")
        epoch, _, step = stem.partition("_it_")
        return int(epoch), float(step) if step else float("inf")

    return sorted(names, key=key)


def test_the_lister_finder_and_pruner_order_checkpoint_names_of_both_formats_alike(tmp_path):
    files = [ckpt.checkpoint_name(e, s) for e, s in [(2, 0), (10, 0), (3, 7), (3, 0), (3, 12), (1, 5)]]
    folders = [ckpt.checkpoint_name(e, s, sharded=True) for e, s in [(3, 9), (2, 100), (11, 0)]]
    assert folders == ["ckpt_ep_003_it_000009.dcp", "ckpt_ep_002_it_000100.dcp", "ckpt_ep_011.dcp"]
    for name in files:
        ckpt.save_checkpoint({"model": {}}, str(tmp_path / name))
    for name in folders:
        os.makedirs(tmp_path / name)
    decoys = ["best.pth.tar", "ckpt_ep_004.pth.tar.corrupt", "ckpt_ep_005.pth.tar.tmp.77", "ckpt_ep_006.dcp.tmp.8"]
    decoys += [".ckpt_ep_007.pth.tar.x1y2.part", ".ckpt_ep_008.dcp.a_b.part", "ckpt_ep_009.dcp.old.12"]
    for name in decoys:
        (tmp_path / name).write_bytes(b"")

    def listed(paths: list[str]) -> list[str]:
        return [os.path.basename(p) for p in paths]

    assert listed(ckpt.list_checkpoints(str(tmp_path))) == _expected_order(files)
    assert listed(ckpt.list_checkpoints(str(tmp_path), "sharded")) == _expected_order(folders)
    assert listed(ckpt.list_checkpoints(str(tmp_path), "any")) == _expected_order(files + folders)
    assert ckpt.find_resumable(str(tmp_path), verify=lambda path: None) == str(tmp_path / _expected_order(folders)[-1])

    ckpt.prune_checkpoints(str(tmp_path), keep=2)
    ckpt.prune_checkpoints(str(tmp_path), keep=1, fmt="sharded")
    left = sorted(os.listdir(tmp_path))
    kept = _expected_order(files)[-2:] + _expected_order(folders)[-1:]
    assert left == sorted(kept + ["best.pth.tar", "ckpt_ep_004.pth.tar.corrupt"]), (
        "stale temporaries of both namings go"
    )


def test_a_checkpoint_that_cannot_be_pruned_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    for epoch in (1, 2):
        ckpt.save_checkpoint({"model": {}}, str(tmp_path / ckpt.checkpoint_name(epoch)))

    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "remove", refuse)
    with pytest.raises(ckpt.CheckpointError, match=f"could not remove an old checkpoint in {tmp_path}: .*Permission"):
        ckpt.prune_checkpoints(str(tmp_path), keep=1)
    assert len(ckpt.list_checkpoints(str(tmp_path))) == 2


CHECKPOINT_MODULES = (
    "checkpointing.checkpoint",
    "checkpointing.names",
    "checkpointing.single_file",
    "checkpointing.sharded",
    "training.components",
    "training.resume",
)


def _imports(module: str) -> set[str]:
    """The distribuuuu modules ``module`` imports anywhere in its body (function-level imports included)."""
    tree = ast.parse((REPO / "distribuuuu" / f"{module.replace('.', '/')}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distribuuuu"):
            base = node.module.removeprefix("distribuuuu").lstrip(".")
            found |= {f"{base}.{alias.name}".lstrip(".") for alias in node.names} | {base}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("distribuuuu.") for a in node.names if a.name.startswith("distribuuuu.")}
    return found


def test_the_checkpoint_modules_import_in_one_direction():
    graph = {m: _imports(m) & set(CHECKPOINT_MODULES) for m in CHECKPOINT_MODULES}

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    circles = [m for m in CHECKPOINT_MODULES if reaches(m, m)]
    assert not circles, f"import circle through {circles}: {graph}"
    assert not reaches("checkpointing.sharded", "checkpointing.checkpoint")
    assert not reaches("checkpointing.single_file", "checkpointing.sharded")
    assert reaches("training.resume", "checkpointing.checkpoint")  # the reader sees the imports it checks
