"""Every file a user hands us as a checkpoint is hostile: crafted ones are refused and never run code.

The corpus: a payload (a pickle whose ``__reduce__`` creates a marker file) in a ``.pth.tar``, in a
``.dcp``'s ``.metadata`` (its manifest re-signed, so the checksums pass), in a ``.distcp`` entry, in
``extra.pt``; a manifest naming a file outside its folder; an image, a config and a folder of images
given as checkpoints; truncated files; an empty ``.metadata``; ``.metadata`` bytes mutated at random.
Each is refused in one line or loads (when harmless), and the marker never appears. The ``.metadata``
payload is read by every path that reads a checkpoint: the tools, run in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import EVAL_TINY, REPO, TEST, TRAIN, Payload, PlainState, in_process, lone_env, read_metrics
from models import CONV_BN_HEAD, TINY_ARCH, conv_bn_head, tiny_cnn
from PIL import Image
from torch import nn

from distribuuuu.checkpointing.checkpoint import (
    CheckpointError,
    RefusedCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from distribuuuu.checkpointing.dcp_reader import read_metadata
from distribuuuu.checkpointing.sharded import MANIFEST, METADATA, load_states, save_states
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.training.convert import save_sharded
from distribuuuu.training.ema import ModelEMA
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.resume import load_weights

PREDICT, EXPORT = str(REPO / "tools" / "predict.py"), str(REPO / "tools" / "export.py")
CONVERT, AVG = str(REPO / "tools" / "convert_checkpoint.py"), str(REPO / "tools" / "avg_checkpoints.py")
DIGITS = str(REPO / "data" / "digits")
IMAGE = REPO / "data" / "digits" / "val" / "3" / "0023.png"
RUN_OPTS = [*EVAL_TINY, "OPTIM.EMA_DECAY", "0.5", "DIST.CKPT_FORMAT", "sharded", "LOG.PLOT", "False",
            "TRAIN.DATASET", DIGITS, "TEST.DATASET", DIGITS]  # fmt: skip
CKPT = Path("checkpoints") / "ckpt_ep_001.dcp"


def _touch(marker: Path) -> Payload:
    return Payload(os.system, (f"touch {marker}",))


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory) -> Path:
    """One epoch of the tiny CNN with EMA, checkpointed sharded (OUT_DIR/checkpoints/ckpt_ep_001.dcp)."""
    out = tmp_path_factory.mktemp("dcp_run") / "out"
    result = in_process(TRAIN, "OUT_DIR", str(out), *RUN_OPTS, "OPTIM.MAX_EPOCH", "1", env=lone_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def resign(folder: Path) -> None:
    """Rewrite ``folder``'s manifest to match its files: what anyone who can write the folder can do."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def plant_in_metadata(folder: Path, payload: object) -> None:
    """Make ``folder``'s .metadata run ``payload`` while it is unpickled, then read as before; re-sign it."""
    with open(folder / METADATA, "rb") as f:
        metadata = pickle.load(f)  # the suite's own file
    metadata.note = payload  # in the Metadata's pickled state, after every entry DCP needs
    with open(folder / METADATA, "wb") as f:
        pickle.dump(metadata, f)
    resign(folder)


READ_PATHS = ["resume", "train MODEL.WEIGHTS", "test_net MODEL.WEIGHTS", "DISTILL.TEACHER", "predict.py",
              "export.py", "convert_checkpoint.py", "avg_checkpoints.py"]  # fmt: skip


def _read(how: str, run: Path, tmp_path: Path, ckpt: Path = CKPT):
    """Hand ``run``'s checkpoint ``ckpt`` to the tool (in this process) as ``how`` reads it (resume and
    avg_checkpoints.py: the newest of run/checkpoints)."""
    weights, new_out = str(run / ckpt), str(tmp_path / "new")
    if how == "resume":
        return in_process(TRAIN, "OUT_DIR", str(run), *RUN_OPTS, "OPTIM.MAX_EPOCH", "2", env=lone_env())
    if how == "train MODEL.WEIGHTS":
        return in_process(TRAIN, "OUT_DIR", new_out, *RUN_OPTS, "OPTIM.MAX_EPOCH", "1", "MODEL.WEIGHTS", weights)
    if how == "DISTILL.TEACHER":
        return in_process(TRAIN, "OUT_DIR", new_out, *RUN_OPTS, "OPTIM.MAX_EPOCH", "1", "DISTILL.TEACHER", weights)
    if how == "test_net MODEL.WEIGHTS":
        return in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", new_out)
    if how == "predict.py":
        return in_process(PREDICT, "--weights", weights, str(IMAGE))
    if how == "export.py":
        return in_process(EXPORT, "--weights", weights, "--out", str(tmp_path / "exported"))
    if how == "convert_checkpoint.py":
        return in_process(CONVERT, weights, str(tmp_path / "converted.pth.tar"))
    return in_process(AVG, str(run), "--last", "1", "-o", str(tmp_path / "avg.pth.tar"))


@pytest.mark.parametrize("how", READ_PATHS)
def test_a_dcp_metadata_that_would_run_code_is_refused_on_every_read_path(dcp_run, tmp_path, how):
    """torch reads .metadata with a plain pickle.load (pytorch issue 189308), before any check of
    DCP's own: a crafted one, its manifest re-signed, must be refused by every tool, exit 2, in one
    line naming the folder and the global, and run nothing."""
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    shutil.copytree(dcp_run, run)
    plant_in_metadata(run / CKPT, _touch(marker))
    metrics_before = read_metrics(run)
    result = _read(how, run, tmp_path)
    assert not marker.exists(), f"{how}: the checkpoint's code ran"
    assert result.returncode == 2, (how, result.returncode, result.stderr[-3000:])
    said = [line for line in result.stderr.splitlines() if "GLOBAL posix.system" in line]
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"refusing to load {run / CKPT}: its .metadata holds a global that DCP metadata never holds" in said[0]
    # Nothing lost, nothing trained: the checkpoint stays where it was (not moved aside as a torn one).
    assert (run / CKPT / METADATA).is_file() and not list(run.glob("checkpoints/*.corrupt"))
    assert read_metrics(run) == metrics_before


@pytest.mark.parametrize("how", READ_PATHS)
def test_an_image_given_as_a_checkpoint_is_named_as_one_on_every_read_path(dcp_run, tmp_path, how):
    """torch.load refuses a JPEG as holding objects weights_only=True does not allow, which suggests
    an unsafe load of what is no checkpoint: every tool names what it is instead, exit 2, one line."""
    run, jpeg = tmp_path / "run", Path("checkpoints") / "ckpt_ep_002.pth.tar"  # the newest: resumed, averaged
    shutil.copytree(dcp_run, run)
    Image.open(IMAGE).convert("RGB").save(run / jpeg, format="JPEG")
    result = _read(how, run, tmp_path, jpeg)
    assert result.returncode == 2, (how, result.returncode, result.stderr[-3000:])
    said = [line for line in result.stderr.splitlines() if "JPEG" in line]
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{run / jpeg} is not a checkpoint (a JPEG image)" in said[0]
    assert (run / jpeg).is_file(), "left where it was: no torn checkpoint to move aside"


# ------------------------------------------------------------------------------------------------
# The corpus, read by the library's front door (load_checkpoint: every tool's read of a checkpoint)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory) -> Path:
    """A real DCP folder of a model, its optimizer (param_groups: pickled entries) and EMA."""
    torch.manual_seed(0)
    model = tiny_cnn(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    path = tmp_path_factory.mktemp("small") / "small.dcp"
    save_sharded(str(path), model, optimizer, {"epoch": 1, "classes": ["a", "b", "c"]}, ModelEMA(model, 0.5))
    return path


def _metadata_with(folder: Path, change) -> None:
    """Rewrite ``folder``'s .metadata with ``change(metadata)`` applied, and re-sign the manifest."""
    with open(folder / METADATA, "rb") as f:
        metadata = pickle.load(f)  # the suite's own file
    change(metadata)
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    resign(folder)


def _replace(folder: Path, name: str, data: bytes) -> None:
    (folder / name).write_bytes(data)
    resign(folder)


def _first_entry_outside(metadata) -> None:
    where = next(iter(metadata.storage_data.values()))
    where.relative_path = "/etc/hostname"


def _pickled_file(tmp: Path, marker: Path) -> Path:
    path = tmp / "evil.pth.tar"
    torch.save({"model": {"w": torch.zeros(2)}, "extra": _touch(marker)}, path)
    return path


def _distcp_entry(tmp: Path, marker: Path) -> Path:
    """A payload among the optimizer's param_groups: a pickled (non-tensor) entry of a .distcp file."""
    path = tmp / "evil.dcp"
    optimizer = PlainState({"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"], "note": _touch(marker)}]})
    save_states(str(path), {"model": PlainState({"w": torch.zeros(2)}), "optimizer": optimizer}, {"epoch": 1})
    return path


def _image(tmp: Path, fmt: str) -> Path:
    path = tmp / "photo.pth.tar"
    Image.open(IMAGE).convert("RGB").save(path, format=fmt)
    return path


def _truncated_file(tmp: Path) -> Path:
    path = tmp / "torn.pth.tar"
    save_checkpoint({"model": tiny_cnn(3).state_dict()}, str(path))
    path.write_bytes(path.read_bytes()[:2000])
    return path


# name: (make the crafted checkpoint from (the small DCP's copy, tmp folder, marker) -> its path,
#        the refusal's class, a pattern of its message; None: harmless, it loads)
CORPUS = {
    "payload in a .pth.tar": (
        lambda d, tmp, m: _pickled_file(tmp, m), RefusedCheckpointError,
        r"refusing to load {path}: it holds objects that weights_only=True does not allow \(GLOBAL posix\.system\)",
    ),
    "payload in .metadata, manifest re-signed": (
        lambda d, tmp, m: plant_in_metadata(d, _touch(m)) or d, RefusedCheckpointError,
        r"refusing to load {path}: its \.metadata holds a global that DCP metadata never holds \(GLOBAL posix\.system\)",
    ),
    "exec in .metadata": (
        lambda d, tmp, m: plant_in_metadata(d, Payload(exec, (f"open({str(m)!r}, 'w')",))) or d,
        RefusedCheckpointError, r"never holds \(GLOBAL builtins\.exec\)",
    ),
    "torch.load in .metadata (an allowed module, another name)": (
        lambda d, tmp, m: _replace(d, METADATA, f"ctorch\nload\n(V{m}\ntR.".encode()) or d,
        RefusedCheckpointError, r"never holds \(GLOBAL torch\.load\)",
    ),
    "a module reached through an allowed one": (
        lambda d, tmp, m: _replace(d, METADATA, b"ctorch.distributed.checkpoint.metadata\ntorch\n.") or d,
        RefusedCheckpointError, r"never holds \(GLOBAL torch\.distributed\.checkpoint\.metadata\.torch\)",
    ),
    "a dotted name under an allowed class": (
        lambda d, tmp, m: _replace(d, METADATA, b"\x80\x04\x8c\x05torch\x8c\x0cSize.__new__\x93.") or d,
        RefusedCheckpointError, r"never holds \(GLOBAL torch\.Size\.__new__\)",
    ),
    "payload in a .distcp entry": (
        lambda d, tmp, m: _distcp_entry(tmp, m), RefusedCheckpointError,
        r"refusing to load {path}: it holds objects that weights_only=True does not allow \(GLOBAL posix\.system\)",
    ),
    "payload in extra.pt, manifest re-signed": (
        lambda d, tmp, m: torch.save({"epoch": 1, "rng": _touch(m)}, d / "extra.pt") or resign(d) or d,
        RefusedCheckpointError, r"refusing to load {path}/extra\.pt: it holds objects .*\(GLOBAL posix\.system\)",
    ),
    "a manifest naming a file outside its folder": (
        lambda d, tmp, m: _manifest_naming(d, "../outside"), CheckpointError, r"names '\.\./outside', not a file of {path}",
    ),
    "an entry placed outside the folder": (
        lambda d, tmp, m: _metadata_with(d, _first_entry_outside) or d, CheckpointError, r"places an entry outside {path}",
    ),
    "a pickle that is no DCP metadata": (
        lambda d, tmp, m: _replace(d, METADATA, pickle.dumps({"state_dict_metadata": {}})) or d,
        CheckpointError, r"does not hold DCP metadata \(a dict\)",
    ),
    "a persistent id in .metadata": (
        lambda d, tmp, m: _replace(d, METADATA, b"Pabc\n.") or d, CheckpointError, r"\.metadata is unreadable",
    ),
    "a memo index of 2**31 in .metadata (the C unpickler would allocate 16 GB for it)": (
        lambda d, tmp, m: _replace(d, METADATA, b"\x80\x02K\x01r\xff\xff\xff\x7f.") or d, CheckpointError,
        r"does not hold DCP metadata \(a int\)",
    ),
    "an empty .metadata": (
        lambda d, tmp, m: _replace(d, METADATA, b"") or d, CheckpointError, r"\.metadata is unreadable .*EOFError",
    ),
    "a truncated .metadata": (
        lambda d, tmp, m: _replace(d, METADATA, (d / METADATA).read_bytes()[:500]) or d, CheckpointError,
        r"\.metadata is unreadable \(truncated or corrupt\?\)",
    ),
    "a truncated .pth.tar": (
        lambda d, tmp, m: _truncated_file(tmp), CheckpointError, r"checkpoint {path} is unreadable \(truncated or corrupt\?\)",
    ),
    "a JPEG renamed .pth.tar": (
        lambda d, tmp, m: _image(tmp, "JPEG"), RefusedCheckpointError, r"^{path} is not a checkpoint \(a JPEG image\)$",
    ),
    "a PNG renamed .pth.tar": (
        lambda d, tmp, m: _image(tmp, "PNG"), RefusedCheckpointError, r"^{path} is not a checkpoint \(a PNG image\)$",
    ),
    "a config given as a checkpoint": (
        lambda d, tmp, m: shutil.copy(REPO / "config" / "digits_recipe.yaml", tmp / "x.pth.tar") and tmp / "x.pth.tar",
        RefusedCheckpointError, r"^{path} is not a checkpoint \(a text file\)$",
    ),
    "a folder of images given as a .dcp": (
        lambda d, tmp, m: Path(shutil.copytree(REPO / "data" / "digits" / "val" / "3", tmp / "imgs.dcp")),
        RefusedCheckpointError, r"^{path} is not a checkpoint \(a folder of \d+ entries without DCP's \.metadata\)$",
    ),
    "a real checkpoint (control)": (lambda d, tmp, m: d, None, ""),
}  # fmt: skip


# The cases whose flaw lies in what resuming a folder reads before its shards: its .metadata and extra.pt.
RESUME_READS = {name for name in CORPUS if ".metadata" in name or "extra.pt" in name or "allowed" in name}
RESUME_READS |= {"an entry placed outside the folder", "a pickle that is no DCP metadata"}


def _manifest_naming(folder: Path, name: str) -> Path:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("crafted", list(CORPUS))
def test_a_crafted_checkpoint_is_refused_in_one_line_or_loads_and_never_runs_code(small_dcp, tmp_path, crafted):
    make, refused, pattern = CORPUS[crafted]
    marker, folder = tmp_path / "PWNED", tmp_path / "copy.dcp"
    shutil.copytree(small_dcp, folder)
    path = make(folder, tmp_path, marker)
    if refused is None:
        assert load_checkpoint(str(path))["epoch"] == 1
    else:
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(str(path))
        message = str(caught.value)
        assert type(caught.value) is refused, message
        assert re.search(pattern.format(path=re.escape(str(path))), message) and "\n" not in message, message
        if crafted in RESUME_READS:  # resuming a folder reads these before any shard: refused alike
            with pytest.raises(refused, match=pattern.format(path=re.escape(str(path)))):
                load_states(str(path), {})
    assert not marker.exists(), f"{crafted}: its code ran"


def test_metadata_mutated_at_random_loads_or_is_one_checkpoint_error(small_dcp, tmp_path):
    """500 seeded mutations of a real .metadata (flipped, cut, inserted and spliced bytes, some of a
    payload's): each reads as DCP metadata or raises a CheckpointError, never another exception."""
    original = (small_dcp / METADATA).read_bytes()
    payload = pickle.dumps(_touch(tmp_path / "PWNED"), protocol=0)
    rng, folder, outcomes = random.Random(0), tmp_path / "fuzz.dcp", {"read": 0, "refused": 0, "unreadable": 0}
    folder.mkdir()
    for _ in range(500):
        data = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            kind = rng.choice(("flip", "cut", "insert", "splice"))
            if kind == "flip":
                data[at] ^= 1 << rng.randrange(8)
            elif kind == "cut":
                del data[at : at + rng.randint(1, 64)]
            elif kind == "insert":
                data[at:at] = rng.randbytes(rng.randint(1, 16))
            else:
                data[at:at] = payload[: rng.randint(1, len(payload))]
        (folder / METADATA).write_bytes(bytes(data))
        try:
            read_metadata(str(folder))
            outcomes["read"] += 1
        except RefusedCheckpointError:
            outcomes["refused"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e)
            outcomes["unreadable"] += 1
    assert not (tmp_path / "PWNED").exists()
    assert all(outcomes.values()), f"each outcome reached: {outcomes}"


# ------------------------------------------------------------------------------------------------
# Weights that do not fit: MODEL.WEIGHTS must fill at least half of the model's values
# ------------------------------------------------------------------------------------------------
def test_another_models_weights_are_refused_naming_how_many_tensors_matched(tmp_path):
    path = tmp_path / "conv_bn_head.pth.tar"
    save_checkpoint({"model": conv_bn_head(10).state_dict(), "arch": CONV_BN_HEAD}, str(path))
    own = tiny_cnn(10).state_dict()
    result = in_process(
        TRAIN, "OUT_DIR", str(tmp_path / "out"), *RUN_OPTS, "OPTIM.MAX_EPOCH", "1", "MODEL.WEIGHTS", str(path)
    )
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"distribuuuu: error: MODEL.WEIGHTS: {path} fills 0 of the {len(own)} tensors of MODEL.ARCH {TINY_ARCH}"
    ), line
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "nothing trained"


def test_a_teacher_of_another_model_is_refused_naming_how_many_tensors_matched(tmp_path):
    path = tmp_path / "conv_bn_head.pth.tar"
    save_checkpoint({"model": conv_bn_head(10).state_dict(), "arch": CONV_BN_HEAD}, str(path))
    teacher = ["DISTILL.TEACHER", str(path), "DISTILL.ARCH", TINY_ARCH]
    result = in_process(TRAIN, "OUT_DIR", str(tmp_path / "out"), *RUN_OPTS, "OPTIM.MAX_EPOCH", "1", *teacher)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    own = len(tiny_cnn(10).state_dict())
    assert line.startswith(
        f"distribuuuu: error: DISTILL.TEACHER: {path} does not fit {TINY_ARCH} (it fills 0 of its {own} tensors"
    ), line


def _two_layers(second_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, second_out))


@pytest.mark.parametrize("second_out", [10, 11])
def test_weights_load_when_they_fill_at_least_half_of_the_models_values(tmp_path, second_out):
    """The file holds the first of two layers: 110 of 220 values (loaded), or of 231 (refused)."""
    path = tmp_path / "first_layer.pth.tar"
    first = _two_layers(10)[0]
    save_checkpoint({"model": {f"0.{k}": v for k, v in first.state_dict().items()}}, str(path))
    model = _two_layers(second_out)
    values = sum(v.numel() for v in model.state_dict().values())
    if 110 / values >= 0.5:
        load_weights(model, str(path), strict=False)
        assert torch.equal(model[0].weight, first.weight) and torch.equal(model[0].bias, first.bias)
    else:
        with pytest.raises(
            CheckpointError, match=rf"fills 2 of the 4 tensors of the model \({110 / values:.0%} of its values;"
        ):
            load_weights(model, str(path), strict=False)


def test_fine_tuning_with_a_new_head_still_loads_every_other_tensor(tmp_path):
    """The documented case (docs/fine-tuning.md): a 10-class checkpoint into a 3-class model of its architecture."""
    path = tmp_path / "ten.pth.tar"
    ten = tiny_cnn(10)
    save_checkpoint({"model": ten.state_dict(), "arch": TINY_ARCH}, str(path))
    three = tiny_cnn(3)
    head = {k: v.clone() for k, v in three.state_dict().items() if k.startswith("fc.")}
    load_weights(three, str(path), strict=False)
    for k, v in three.state_dict().items():
        assert torch.equal(v, head[k] if k.startswith("fc.") else ten.state_dict()[k]), k


# ------------------------------------------------------------------------------------------------
# Pretrained weights: a file in torch.hub's cache is a file handed to us too
# ------------------------------------------------------------------------------------------------
def test_pretrained_weights_that_would_run_code_are_refused(tmp_path, monkeypatch):
    """torchvision loads its weights with weights_only=False unless told otherwise, and checks their
    hash only when it downloads them: a file placed in the hub's cache (as the docs say to do
    offline) ran its code."""
    marker = tmp_path / "PWNED"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    cached = tmp_path / "hub" / "checkpoints" / os.path.basename(torchvision.models.ResNet18_Weights.DEFAULT.url)
    cached.parent.mkdir(parents=True)
    torch.save({"conv1.weight": _touch(marker)}, cached)
    cfg = load_cfg(None, ["MODEL.ARCH", "resnet18", "MODEL.PRETRAINED", "True"])
    with pytest.raises(ConfigError, match=r"^MODEL\.PRETRAINED: refusing .*\(GLOBAL posix\.system\)"):
        build_configured_model(cfg.MODEL)
    assert not marker.exists()


def test_a_python_config_is_refused_in_one_line_and_never_run(tmp_path):
    """yacs runs a .py config (merge_from_file, its _load_cfg_py_source); ours are YAML, read with safe_load."""
    marker, config = tmp_path / "PWNED", tmp_path / "evil.py"
    config.write_text(f"import os\nos.system('touch {marker}')\ncfg = {{}}\n")
    result = in_process(TEST, "--cfg", str(config), "MODEL.WEIGHTS", str(tmp_path / "x.pth.tar"))
    assert result.returncode == 2 and not marker.exists(), result.stderr
    assert (
        result.stderr.strip()
        == f"distribuuuu: error: {config}: a Python file; configs are YAML, and no config file is ever run"
    )
