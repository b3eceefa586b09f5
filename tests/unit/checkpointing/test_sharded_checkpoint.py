"""Sharded (DCP) checkpoints: atomic and verified, convertible to one file, in one process.

Resharding across world sizes (2 ranks' checkpoint read by 3, 3 ranks' by 2, bit for bit, and read
whole in one process) is checked through the trainer by tests/integration/test_resume_world_size.py's fsdp chain.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, assert_ok
from torch.distributed.checkpoint.state_dict import get_state_dict

from distribuuuu.checkpointing.checkpoint import (
    CheckpointError,
    checkpoint_name,
    find_resumable,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
)
from distribuuuu.checkpointing.sharded import load_states, verify_sharded
from distribuuuu.training.convert import from_single_file, save_sharded, tensor_states, to_single_file
from distribuuuu.training.ema import ModelEMA
from tests.scripts.fsdp_job import TinyResNet


def _load(path: str, model, optimizer, ema) -> dict:
    """``path`` into model, optimizer and EMA shards (collective), the EMA's update count from its extra state."""
    extra = load_states(path, tensor_states(model, optimizer, ema))
    ema.updates = int(extra["ema_updates"])
    return extra


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    optimizer.step()  # momentum buffers exist
    ema = ModelEMA(model, 0.9)
    ema.update(model)
    return model, optimizer, ema


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _save(tmp_path, epoch: int, seed: int = 0) -> str:
    model, optimizer, ema = _run(seed)
    path = str(tmp_path / checkpoint_name(epoch, sharded=True))
    save_sharded(path, model, optimizer, {"epoch": epoch, "classes": ["a", "b"]}, ema)
    return path


def test_a_checkpoint_appears_whole_under_its_final_name_and_verifies(tmp_path):
    path = _save(tmp_path, 2)
    assert os.path.basename(path) == "ckpt_ep_002.dcp"
    assert sorted(os.listdir(tmp_path)) == ["ckpt_ep_002.dcp"]  # no temporary left behind
    verify_sharded(path)
    model, optimizer, ema = _run(seed=1)
    extra = _load(path, model, optimizer, ema)
    reference = _run(seed=0)
    _assert_same(get_state_dict(model, optimizer), get_state_dict(reference[0], reference[1]))
    _assert_same(ema.state_dict(), reference[2].state_dict())
    assert extra["epoch"] == 2 and extra["classes"] == ["a", "b"]


@pytest.mark.parametrize("damage", ["truncate", "remove", "flip", "no_manifest"])
def test_a_damaged_shard_is_named_and_the_previous_checkpoint_resumes(tmp_path, damage):
    good, bad = _save(tmp_path, 1), _save(tmp_path, 2)
    shard = os.path.join(bad, "__0_0.distcp")
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "remove":
        os.remove(shard)
    elif damage == "flip":
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    else:
        os.remove(os.path.join(bad, "manifest.json"))  # as if the job died before the rename
    expected = {"truncate": "truncated", "remove": "is missing", "flip": "checksum", "no_manifest": "not finished"}
    with pytest.raises(CheckpointError, match=expected[damage]) as err:
        verify_sharded(bad)
    if damage != "no_manifest":
        assert shard in str(err.value)  # one clear error naming the file
    assert find_resumable(str(tmp_path), fmt="sharded") == good
    assert os.path.isdir(bad + ".corrupt")


def test_prune_keeps_the_newest_and_removes_stale_temporaries(tmp_path):
    for epoch in (1, 2, 3):
        _save(tmp_path, epoch)
    os.makedirs(tmp_path / "ckpt_ep_004.dcp.tmp.123")
    prune_checkpoints(str(tmp_path), keep=2, fmt="sharded")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path), "sharded")] == [
        "ckpt_ep_002.dcp",
        "ckpt_ep_003.dcp",
    ]
    assert not (tmp_path / "ckpt_ep_004.dcp.tmp.123").exists()


def test_conversion_to_a_single_file_and_back_round_trips(tmp_path):
    path = _save(tmp_path, 3)
    single = str(tmp_path / "ckpt_ep_003.pth.tar")
    to_single_file(path, single)
    state = load_checkpoint(single)  # verifies the checksum; loads with weights_only
    model, optimizer, ema = _run(seed=0)
    _assert_same(state["model"], model.state_dict())
    _assert_same(state["optimizer"], optimizer.state_dict())  # indexed as Optimizer.state_dict() is
    _assert_same(state["ema"], ema.state_dict())
    assert state["epoch"] == 3 and state["classes"] == ["a", "b"]
    fresh, fresh_optimizer, _ = _run(seed=5)
    back = str(tmp_path / "back" / "ckpt_ep_003.dcp")
    from_single_file(single, back, fresh, fresh_optimizer)
    again = str(tmp_path / "again.pth.tar")
    to_single_file(back, again)
    round_trip = load_checkpoint(again)
    for key in ("model", "optimizer", "ema", "epoch", "classes"):
        _assert_same(round_trip[key], state[key])


@pytest.mark.slow
def test_convert_tool_round_trips_a_trained_checkpoint_and_names_a_bad_input(tmp_path):
    """tools/convert_checkpoint.py on a file shaped like train_net.py's (cfg inside): file -> dcp -> file."""
    from helpers import in_process

    from distribuuuu.checkpointing.checkpoint import save_checkpoint
    from distribuuuu.config import get_cfg_defaults
    from distribuuuu.training.optim import build_optimizer
    from distribuuuu.training.parallelize import build_configured_model

    cfg = get_cfg_defaults()
    cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES = "resnet18", 10
    model = build_configured_model(cfg.MODEL)
    optimizer = build_optimizer(model, cfg.OPTIM)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    single = str(tmp_path / "ckpt_ep_001.pth.tar")
    save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ema": None,
                     "epoch": 1, "cfg": cfg.dump()}, single)  # fmt: skip
    tool = str(REPO / "tools" / "convert_checkpoint.py")
    sharded, back = str(tmp_path / "ckpt_ep_001.dcp"), str(tmp_path / "back.pth.tar")
    assert_ok(in_process(tool, single, sharded))
    assert_ok(in_process(tool, sharded, back))
    original, round_trip = load_checkpoint(single), load_checkpoint(back)
    for key in ("model", "optimizer", "epoch", "cfg"):
        _assert_same(round_trip[key], original[key])
    os.truncate(os.path.join(sharded, "__0_0.distcp"), 10)
    bad = in_process(tool, sharded, str(tmp_path / "x.pth.tar"))
    assert bad.returncode == 2 and "__0_0.distcp" in bad.stderr and "Traceback" not in bad.stderr


def test_a_dcp_directory_is_taken_wherever_a_checkpoint_file_is_and_the_listing_orders_both(tmp_path):
    from distribuuuu.checkpointing.checkpoint import save_checkpoint
    from distribuuuu.training.resume import load_weights

    path = _save(tmp_path, 3)
    model, optimizer, ema = _run(seed=0)
    state = load_checkpoint(path)  # what test_net.py, predict.py and MODEL.WEIGHTS read: no process group
    _assert_same(state["model"], model.state_dict())
    _assert_same(state["optimizer"], optimizer.state_dict())
    fresh = _run(seed=5)[0]
    load_weights(fresh, path, "ema")
    _assert_same(fresh.state_dict(), ema.module.state_dict())
    save_checkpoint({"model": {}}, str(tmp_path / "ckpt_ep_002.pth.tar"))
    save_checkpoint({"model": {}}, str(tmp_path / "ckpt_ep_003_it_000004.pth.tar"))
    names = [os.path.basename(p) for p in list_checkpoints(str(tmp_path), "any")]
    assert names == ["ckpt_ep_002.pth.tar", "ckpt_ep_003_it_000004.pth.tar", "ckpt_ep_003.dcp"]
    os.remove(os.path.join(path, "extra.pt"))
    with pytest.raises(CheckpointError, match="extra.pt"):
        load_checkpoint(path)  # verified before it is trusted
