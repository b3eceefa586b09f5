"""Bad checkpoint files: a truncated or empty newest moved aside for an older one, files (single and
sharded) that would run code refused, a key-named checkpoint unreadable as bad input, a flipped bit
caught by the checksum, and the original distribuuuu's load_checkpoint call explained."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch
from fault_helpers import DIGITS, _tiny_state
from helpers import FAST, Payload, PlainState

from distribuuuu import cli, trainer, utils
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import CheckpointError, find_resumable, load_checkpoint, save_checkpoint
from distribuuuu.checkpointing.sharded import load_states, save_states
from distribuuuu.config import ConfigError

pytestmark = pytest.mark.usefixtures("plain_logging")


def test_find_resumable_moves_broken_newest_aside_and_falls_back(tmp_path, caplog):
    paths = [tmp_path / ckpt.checkpoint_name(e) for e in (1, 2, 3)]
    for e, p in enumerate(paths, 1):
        save_checkpoint(_tiny_state(e), str(p))
    paths[2].write_bytes(paths[2].read_bytes()[:100])  # truncated
    paths[1].write_bytes(b"")  # empty
    with caplog.at_level("WARNING"):
        assert find_resumable(str(tmp_path)) == str(paths[0])
    for broken in paths[1:]:
        assert not broken.exists() and Path(f"{broken}.corrupt").is_file()
        assert any(str(broken) in r.getMessage() and "moved it aside" in r.getMessage() for r in caplog.records)
    assert find_resumable(str(tmp_path / "none")) is None


@pytest.mark.parametrize("kind", ["os.system", "open"])
def test_checkpoint_that_would_run_code_is_refused(tmp_path, kind):
    marker = tmp_path / "pwned"
    payload = Payload(os.system, (f"touch {marker}",)) if kind == "os.system" else Payload(open, (str(marker), "w"))
    path = tmp_path / "evil.pth.tar"
    torch.save({"model": {"w": torch.zeros(2)}, "extra": payload}, path)
    with pytest.raises(CheckpointError, match=f"refusing to load {re.escape(str(path))}") as refused:
        load_checkpoint(str(path))
    assert not marker.exists()
    named = f"GLOBAL {payload.fn.__module__}.{payload.fn.__name__}"  # what torch refused: posix.system, io.open
    assert f"weights_only=True does not allow ({named}); if you trust its source" in str(refused.value)


@pytest.mark.parametrize("read", ["whole", "resume"])
def test_a_sharded_checkpoint_that_would_run_code_is_refused(tmp_path, read):
    """DCP itself unpickles a checkpoint's non-tensor entries with weights_only=False: read whole
    (evaluation, MODEL.WEIGHTS, the converter) or resumed, a .dcp is refused as a file is."""
    marker, path = tmp_path / "pwned", tmp_path / "evil.dcp"
    save_states(str(path), {"model": PlainState({"w": torch.zeros(2), "note": Payload(open, (str(marker), "w"))})}, {})
    with pytest.raises(CheckpointError, match=f"^refusing to load {re.escape(str(path))}: .*weights_only=True"):
        if read == "whole":
            load_checkpoint(str(path))
        else:
            load_states(str(path), {"model": PlainState({"w": torch.ones(2), "note": None})})
    assert not marker.exists()


def test_train_net_refuses_malicious_weights_in_one_line(tmp_path, capsys):
    """train_net.py's own entry point (cli.run_tool(train_model)), in this process."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth.tar"
    torch.save({"model": Payload(os.system, (f"touch {marker}",))}, path)
    args = ["OUT_DIR", str(tmp_path / "out"), *FAST, "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]
    assert cli.run_tool(trainer.train_model, [*args, "MODEL.WEIGHTS", str(path)]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("distribuuuu: error:")]
    assert len(errors) == 1 and f"refusing to load {path}" in errors[0], err[-3000:]
    assert "Traceback" not in err and not marker.exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "nothing trained"


@pytest.mark.parametrize("failure", ["truncated", "EIO"])
def test_a_checkpoint_a_key_names_is_bad_input_unless_the_machine_failed_to_read_it(tmp_path, monkeypatch, failure):
    path = str(tmp_path / "ckpt.pth.tar")
    save_checkpoint({"model": {"w": torch.zeros(4)}}, path)
    if failure == "truncated":
        with open(path, "r+b") as f:
            f.truncate(100)
    else:

        def failing_disk(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(torch, "load", failing_disk)
    raised = ConfigError if failure == "truncated" else CheckpointError  # exit 2, or a failed run's exit 1
    with pytest.raises(raised) as caught, ckpt.named_by("MODEL.WEIGHTS"):
        load_checkpoint(path)
    assert type(caught.value) is raised and f"checkpoint {path} is unreadable" in str(caught.value)


def test_the_original_distribuuuus_load_checkpoint_call_says_how_to_load_a_model(tmp_path):
    path = str(tmp_path / "ckpt.pth.tar")
    model = torch.nn.Linear(2, 2)
    save_checkpoint({"model": model.state_dict()}, path)
    with pytest.raises(TypeError, match=r"model.load_state_dict\(load_checkpoint\(path\)\['model'\]\)"):
        utils.load_checkpoint(path, model)  # the original's (path, model): a model is no map_location
    model.load_state_dict(utils.load_checkpoint(path)["model"])  # what the message says works


def test_flipped_bit_in_tensor_data_fails_the_checksum(tmp_path):
    path = tmp_path / "ckpt.pth.tar"
    weights = torch.arange(256, dtype=torch.float32)
    save_checkpoint({"model": {"w": weights}}, str(path))
    data = bytearray(path.read_bytes())
    offset = data.find(weights.numpy().tobytes())
    assert offset > 0
    data[offset + 513] ^= 0x04
    path.write_bytes(data)
    assert not torch.equal(load_checkpoint(str(path), verify=False)["model"]["w"], weights), "torch.load accepts it"
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))} fails its checksum"):
        load_checkpoint(str(path))
