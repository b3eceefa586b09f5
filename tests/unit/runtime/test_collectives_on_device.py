"""Every collective of the package and its tools gets tensors on the run's device.

NCCL serves no host tensors: an all-reduce of ``torch.tensor([x])`` (no ``device=``) ends a GPU
job. On a CPU the run's device *is* the host, so a device check alone cannot fail here, and a
``"cuda:gloo"`` group rejects every CPU tensor, the correct ones included. The stand-in is a
virtual device: ``HostTensors`` (a TorchFunctionMode) marks the tensors that a GPU run would hold
in host memory (made by a factory without ``device=``, moved with ``.cpu()``, or computed only
from such tensors; ``.to(device)`` and ``device=`` put them on the device, as on a GPU), and the
public collectives of ``torch.distributed`` are wrapped to reject marked tensors, naming the
caller. The runs use a one-rank gloo group in this process, so every collective is really called.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch
import torch.distributed as dist
from helpers import FAST, REPO
from models import CONV_BN_HEAD
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from distribuuuu.config import load_cfg
from distribuuuu.runtime.launcher import find_free_port
from distribuuuu.runtime.process_group import all_reduce_sum, cleanup_distributed

DIGITS = str(REPO / "data" / "digits")
TENSOR_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)  # fmt: skip
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.linspace,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.from_numpy,
}  # fmt: skip
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_MARK = "_distribuuuu_on_host"


def on_host(t: torch.Tensor) -> bool:
    return getattr(t, _MARK, False)


def _moved_to_host(func, args, kwargs) -> bool | None:
    """Where a move puts the tensor: host (True), device (False), or unchanged (None: a dtype only)."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.cuda:
        return False
    for a in [*args[1:], kwargs.get("device"), kwargs.get("other")]:
        if isinstance(a, torch.Tensor):
            return on_host(a)
        if isinstance(a, (str, torch.device)):
            return False  # .to(env.device): on a GPU, the run's device
    return None


class HostTensors(TorchFunctionMode):
    """Mark the tensors a GPU run would hold in host memory (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        moved = _moved_to_host(func, args, kwargs) if func in MOVES else None
        if moved is not None:
            host, fresh_only = moved, False
        elif kwargs.get("device") is not None:
            host, fresh_only = False, True
        elif func in FACTORIES:
            host, fresh_only = True, True
        elif inputs:  # an op computes on the device when any operand is there (a CPU scalar joins a GPU tensor)
            host, fresh_only = all(on_host(t) for t in inputs), True
        else:
            return out
        for t in pytree.tree_leaves(out):
            # An in-place op or a view keeps its tensor where it was; a move re-marks even a no-op copy.
            if isinstance(t, torch.Tensor) and not (fresh_only and any(t is i for i in inputs)):
                setattr(t, _MARK, host)
        return out


def _caller() -> str:
    """The first frame in distribuuuu/ or tools/ above the collective helpers of distributed.py."""
    frames = [f for f in inspect.stack()[2:] if os.path.relpath(f.filename, REPO).startswith(("distribuuuu", "tools"))]
    helper = os.path.join("distribuuuu", "runtime", "process_group.py")
    frame = next((f for f in frames if os.path.relpath(f.filename, REPO) != helper), frames[0] if frames else None)
    return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno} {frame.function}" if frame else "?"


@pytest.fixture
def strict_collectives(monkeypatch):
    """Wrap the tensor collectives to record each host tensor they get; yield the list of offences."""
    offences: list[str] = []
    calls: list[str] = []

    def wrap(name, original):
        def collective(*args, **kwargs):
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            calls.append(name)
            if any(on_host(t) for t in tensors):
                offences.append(f"dist.{name} got a host tensor at {_caller()}")
            return original(*args, **kwargs)

        return collective

    for name in TENSOR_COLLECTIVES:
        monkeypatch.setattr(dist, name, wrap(name, getattr(dist, name)))
    with HostTensors():
        yield offences, calls


@pytest.fixture
def one_rank_group(monkeypatch):
    """The launcher variables of a one-rank torchrun job: setup_distributed starts a real gloo group."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "CUDA_VISIBLE_DEVICES": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield
    cleanup_distributed()


def test_the_stand_in_rejects_a_host_tensor_and_passes_a_device_tensor(strict_collectives, one_rank_group):
    from distribuuuu.runtime.process_group import setup_distributed

    offences, _ = strict_collectives
    env = setup_distributed("gloo")
    on_device = torch.tensor([2.0], device=env.device)
    all_reduce_sum(on_device * 3)  # computed on the device: still there
    all_reduce_sum(torch.zeros(3).to(env.device))  # moved there
    assert offences == []
    all_reduce_sum(torch.tensor([2.0]))
    all_reduce_sum(on_device.cpu() + 1)
    assert len(offences) == 2 and "distribuuuu/runtime/process_group.py" in offences[0], offences


def _benchmark_tool():
    spec = importlib.util.spec_from_file_location("benchmark_tool", REPO / "tools" / "benchmark.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.usefixtures("plain_logging")
def test_benchmark_data_measurement_all_reduces_on_the_run_device(strict_collectives, one_rank_group, capsys):
    offences, calls = strict_collectives
    tool = _benchmark_tool()
    args = ["--what", "data", "--workers", "0", "--data-batches", "1", "--repeats", "1", *FAST]
    args += ["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "16"]
    records = tool.benchmark(*tool.parse_bench_args(args))
    assert [r["what"] for r in records] == ["data"]
    assert "all_reduce" in calls
    assert offences == []


@pytest.mark.slow
@pytest.mark.usefixtures("plain_logging")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_and_evaluation_collectives_get_device_tensors(strategy, strict_collectives, one_rank_group, tmp_path):
    from distribuuuu import trainer

    offences, calls = strict_collectives
    opts = [*FAST, "MODEL.ARCH", CONV_BN_HEAD, "OPTIM.MAX_EPOCH", "1"]
    opts += ["TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "128"]
    opts += ["TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS, "DIST.STRATEGY", strategy, "OPTIM.EMA_DECAY", "0.9"]
    opts += ["OUT_DIR", str(tmp_path)]
    trainer.train_model(load_cfg(None, opts))
    assert "all_reduce" in calls and "broadcast" in calls
    assert offences == []
