"""Config: defaults, overrides and YAML merge; every bad input stops the run with one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from helpers import ERROR_PREFIX, REPO, TRAIN, assert_ok, in_process, read_metrics

from distribuuuu.cli import parse_args
from distribuuuu.config import (
    ConfigError,
    config_changes,
    config_diff,
    dump_cfg,
    flatten,
    get_cfg_defaults,
    load_cfg,
    validate_cfg,
)

EXIT_BAD_INPUT = 2
TINY_DUMMY = ["DATA.DUMMY_SIZE", "64", "OPTIM.MAX_EPOCH", "1", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]


# ------------------------------------------------------------------------------------------------
# Loading and merging (in process)
# ------------------------------------------------------------------------------------------------
def test_defaults_load_validate_and_freeze():
    defaults = get_cfg_defaults()
    validate_cfg(defaults)
    cfg = load_cfg()
    assert cfg == defaults
    assert cfg.is_frozen()
    with pytest.raises(AttributeError):
        cfg.TRAIN.BATCH_SIZE = 1


def test_get_cfg_defaults_returns_an_independent_copy():
    first = get_cfg_defaults()
    first.TRAIN.BATCH_SIZE = 999
    assert get_cfg_defaults().TRAIN.BATCH_SIZE != 999


def test_key_value_overrides_apply_with_int_widened_to_float_and_lists_parsed():
    cfg = load_cfg(opts=["OPTIM.BASE_LR", "1", "OPTIM.STEPS", "[2, 4]", "TRAIN.BATCH_SIZE", "8", "MODEL.ARCH", "vgg11"])
    assert cfg.OPTIM.BASE_LR == 1.0 and isinstance(cfg.OPTIM.BASE_LR, float)
    assert cfg.OPTIM.STEPS == [2, 4]
    assert cfg.TRAIN.BATCH_SIZE == 8
    assert cfg.MODEL.ARCH == "vgg11"


def test_yaml_file_is_merged_then_command_line_overrides_win(tmp_path):
    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text("TRAIN:\n  BATCH_SIZE: 16\n  TOPK: 3\nOPTIM:\n  BASE_LR: 0.2\n  WARMUP_EPOCHS: 2\n")
    cfg = load_cfg(str(cfg_file), ["TRAIN.BATCH_SIZE", "8"])
    assert cfg.TRAIN.BATCH_SIZE == 8, "the command line wins over the file"
    assert cfg.TRAIN.TOPK == 3 and cfg.OPTIM.BASE_LR == 0.2, "the file wins over the defaults"
    assert cfg.OPTIM.WARMUP_EPOCHS == 2.0 and isinstance(cfg.OPTIM.WARMUP_EPOCHS, float)
    assert cfg.TEST.BATCH_SIZE == get_cfg_defaults().TEST.BATCH_SIZE, "untouched keys keep their defaults"


def test_a_bad_yaml_file_names_the_file_and_the_key(tmp_path):
    cfg_file = tmp_path / "typo.yaml"
    cfg_file.write_text("TRAIN:\n  BATCH_SIZ: 16\n")
    with pytest.raises(ConfigError) as err:
        load_cfg(str(cfg_file))
    assert str(cfg_file) in str(err.value) and "TRAIN.BATCH_SIZ" in str(err.value)


# A config in the form the original Distribuuuu wrote them (every key, `null` for unset ones).
DISTRIBUUUU_STYLE_YAML = """\
CFG_DEST: config.yaml
CUDNN: {BENCHMARK: true, DETERMINISTIC: false}
MODEL: {ARCH: resnet18, DUMMY_INPUT: false, NUM_CLASSES: 1000, PRETRAINED: false, SYNCBN: false, WEIGHTS: null}
OPTIM:
  BASE_LR: 0.2
  DAMPENING: 0.0
  LR_MULT: 0.1
  LR_POLICY: cos
  MAX_EPOCH: 100
  MIN_LR: 0.0
  MOMENTUM: 0.9
  NESTEROV: true
  STEPS: []
  WARMUP_EPOCHS: 5
  WARMUP_FACTOR: 0.1
  WEIGHT_DECAY: 5.0e-05
OUT_DIR: ./exp
RNG_SEED: null
TEST: {BATCH_SIZE: 200, DATASET: ./data/ILSVRC/, IM_SIZE: 256, PRINT_FREQ: 10, SPLIT: val}
TRAIN: {AUTO_RESUME: true, BATCH_SIZE: 32, DATASET: ./data/ILSVRC/, IM_SIZE: 224, LOAD_OPT: true,
        PIN_MEMORY: true, PRINT_FREQ: 30, SPLIT: train, TOPK: 5, WORKERS: 4}
"""


def test_a_distribuuuu_yaml_file_loads_unchanged_with_its_nulls_meaning_unset(tmp_path):
    cfg_file = tmp_path / "resnet18.yaml"
    cfg_file.write_text(DISTRIBUUUU_STYLE_YAML)
    cfg = load_cfg(str(cfg_file))
    assert cfg.MODEL.NUM_CLASSES == 1000 and cfg.OPTIM.BASE_LR == 0.2 and cfg.OPTIM.STEPS == []
    assert cfg.OPTIM.WARMUP_EPOCHS == 5.0 and cfg.TRAIN.WORKERS == 4 and cfg.TEST.IM_SIZE == 256
    assert cfg.MODEL.WEIGHTS == "", "WEIGHTS: null means no weights"
    assert cfg.RNG_SEED == get_cfg_defaults().RNG_SEED, "RNG_SEED: null still gives a seeded run"


def test_null_for_any_other_key_names_the_key():
    with pytest.raises(ConfigError, match=r"^TRAIN\.BATCH_SIZE must have a value, got null$"):
        load_cfg(opts=["TRAIN.BATCH_SIZE", "None"])


def test_an_odd_override_list_is_refused():
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        load_cfg(opts=["TRAIN.BATCH_SIZE"])


@pytest.mark.parametrize("argv", [["--local_rank", "0"], ["--local-rank=0"]], ids=["local_rank", "local-rank="])
def test_parse_args_accepts_the_old_launchers_local_rank(monkeypatch, argv):
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")  # recorded, so the value parse_args sets is undone afterwards
    args = parse_args([*argv, "--cfg", "x.yaml", "OUT_DIR", "/tmp/o"])
    assert args.local_rank == 0
    assert args.cfg_file == "x.yaml" and args.opts == ["OUT_DIR", "/tmp/o"]
    assert os.environ["LOCAL_RANK"] == "0", "setup_distributed reads LOCAL_RANK from the environment"


def test_dump_cfg_writes_cfg_dest_and_it_loads_back_equal(tmp_path):
    cfg = load_cfg(opts=["CFG_DEST", "merged.yaml", "OPTIM.STEPS", "[1.5, 3]", "DATA.MEAN", "[0.5, 0.5, 0.5]"])
    path = dump_cfg(cfg, str(tmp_path))
    assert path == str(tmp_path / "merged.yaml")
    assert load_cfg(path) == cfg


# ------------------------------------------------------------------------------------------------
# Bad input through tools/train_net.py: exit 2, one line naming the key or path, nothing trained
# ------------------------------------------------------------------------------------------------
BAD_INPUTS = {
    # id: (arguments, what the error line must name)
    "unknown-key": (["TRAIN.BATCH_SIZ", "8"], "TRAIN.BATCH_SIZ"),
    "wrong-type": (["TRAIN.BATCH_SIZE", "abc"], "TRAIN.BATCH_SIZE"),
    "batch-size-0": (["TRAIN.BATCH_SIZE", "0"], "TRAIN.BATCH_SIZE"),
    "topk-above-classes": (["TRAIN.TOPK", "11"], "TRAIN.TOPK"),
    "unknown-lr-policy": (["OPTIM.LR_POLICY", "exp"], "OPTIM.LR_POLICY"),
    "descending-steps": (["OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[4, 2]"], "OPTIM.STEPS"),
    "steps-not-a-list": (["OPTIM.STEPS", "3"], "OPTIM.STEPS"),
    "missing-dataset": (["TRAIN.DATASET", "/nonexistent/imagenet"], "/nonexistent/imagenet"),
    "missing-cfg-file": (["--cfg", "/nonexistent/exp.yaml"], "/nonexistent/exp.yaml"),
    "unknown-arch": (["MODEL.ARCH", "resnet_nope"], "MODEL.ARCH"),
    "negative-shuffle-window": (["DATA.SHUFFLE_WINDOW", "-1"], "DATA.SHUFFLE_WINDOW must be >= 0, got -1"),
    "shuffle-window-with-repeated-sampler": (
        ["DATA.SHUFFLE_WINDOW", "2", "TRAIN.SAMPLER", "repeated"],
        "DATA.SHUFFLE_WINDOW needs TRAIN.SAMPLER default",
    ),
    "shuffle-window-on-an-imagefolder": (
        ["DATA.SHUFFLE_WINDOW", "2"],
        "DATA.SHUFFLE_WINDOW 2 needs a packed TRAIN.DATASET",
    ),
    # Progressive resizing: a ramp from 16 to TRAIN.IM_SIZE (32 by default) in steps of 16 over epochs 0-3, but for one key
    **{
        f"progressive-{name}": (
            [
                "TRAIN.PROGRESSIVE_START_SIZE",
                "16",
                "TRAIN.PROGRESSIVE_SIZE_MULTIPLE",
                "16",
                "TRAIN.PROGRESSIVE_END_EPOCH",
                "3",
                *change,
            ],
            names,
        )
        for name, change, names in [
            (
                "start-off-the-multiple",
                ["TRAIN.PROGRESSIVE_START_SIZE", "24"],
                "TRAIN.PROGRESSIVE_START_SIZE must be 0 (off) or a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE (16) "
                "no larger than TRAIN.IM_SIZE (32, where the ramp ends), got 24: TRAIN.PROGRESSIVE_SIZE_MULTIPLE 8 "
                "(or a divisor of it) fits a ramp from 24 to 32 px",
            ),
            (
                "start-above-im-size",
                ["TRAIN.PROGRESSIVE_START_SIZE", "48"],
                "no larger than TRAIN.IM_SIZE (32, where the ramp ends), got 48",
            ),
            (
                "im-size-off-the-multiple",
                ["TRAIN.IM_SIZE", "40", "TEST.IM_SIZE", "40"],
                "TRAIN.IM_SIZE must be a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE (16) with progressive resizing "
                "(the ramp ends there), got 40: TRAIN.PROGRESSIVE_SIZE_MULTIPLE 8 (or a divisor of it) fits a ramp "
                "from 16 to 40 px",
            ),
            (
                "ramp-ends-before-it-starts",
                ["TRAIN.PROGRESSIVE_START_EPOCH", "3"],
                "TRAIN.PROGRESSIVE_END_EPOCH must be above TRAIN.PROGRESSIVE_START_EPOCH with progressive resizing",
            ),
            ("on-synthetic-data", ["MODEL.DUMMY_INPUT", "True"], "TRAIN.PROGRESSIVE_START_SIZE needs real images"),
        ]
    },  # fmt: skip
    # 32 px images with the default multiple, 32: the line says so, and what would fit
    "progressive-from-16-px-at-the-default-multiple": (
        ["TRAIN.PROGRESSIVE_START_SIZE", "16", "TRAIN.PROGRESSIVE_END_EPOCH", "3"],
        "TRAIN.PROGRESSIVE_START_SIZE must be 0 (off) or a multiple of TRAIN.PROGRESSIVE_SIZE_MULTIPLE (32) no larger "
        "than TRAIN.IM_SIZE (32, where the ramp ends), got 16: TRAIN.PROGRESSIVE_SIZE_MULTIPLE 16 (or a divisor of it) "
        "fits a ramp from 16 to 32 px",
    ),
}


def _argv(case: str, out_dir: Path) -> list[str]:
    args, _ = BAD_INPUTS[case]
    cfg_args = args[:2] if args[0] == "--cfg" else []  # --cfg must precede the KEY VALUE pairs
    return [*cfg_args, "OUT_DIR", str(out_dir), *(args[2:] if cfg_args else args)]


def _assert_one_error_line(stderr: str, names: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), stderr
    assert names in lines[0], f"the error line does not name {names!r}: {lines[0]}"


def _assert_nothing_trained(out_dir: Path) -> None:
    assert not list(Path(out_dir).rglob("*.pth.tar")), "no checkpoint may be written"
    assert not (Path(out_dir) / "metrics.jsonl").exists()


@pytest.mark.usefixtures("plain_logging")
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_naming_it_and_trains_nothing(case, tmp_path, capsys):
    """train_net.py's entry point (cli.run_tool(train_model)) in this process: each case costs no
    Python + torch start-up; the test below runs one case as the real command."""
    from distribuuuu import cli, trainer

    assert cli.run_tool(trainer.train_model, _argv(case, tmp_path)) == EXIT_BAD_INPUT
    _assert_one_error_line(capsys.readouterr().err, BAD_INPUTS[case][1])
    _assert_nothing_trained(tmp_path)


def test_bad_input_to_the_train_net_command_exits_2_with_one_line(tmp_path):
    # train_net.py's own __main__ (in this process): its exit code and what it prints to stderr.
    result = in_process(TRAIN, *_argv("missing-dataset", tmp_path))
    assert result.returncode == EXIT_BAD_INPUT, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr}"
    _assert_one_error_line(result.stderr, BAD_INPUTS["missing-dataset"][1])
    _assert_nothing_trained(tmp_path)


@pytest.mark.slow
def test_missing_dataset_is_fine_with_dummy_input_and_the_merged_config_is_written(tmp_path):
    opts = ["TRAIN.DATASET", "/nonexistent/imagenet", "MODEL.DUMMY_INPUT", "True", *TINY_DUMMY]
    result = in_process(TRAIN, "OUT_DIR", str(tmp_path), *opts)
    assert_ok(result)
    assert ERROR_PREFIX not in result.stderr
    [train] = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    [val] = [r for r in read_metrics(tmp_path) if r["split"] == "val"]
    assert train["epoch"] == 1 and train["samples"] == 64, "trained one epoch on the 64 synthetic images"
    assert val["samples"] == 64
    assert (tmp_path / "checkpoints" / "ckpt_ep_001.pth.tar").is_file()
    # OUT_DIR/config.yaml holds exactly the merged config the run used, its class count resolved
    # (MODEL.NUM_CLASSES 0: the data's, synthetic data's 10).
    written = load_cfg(str(tmp_path / "config.yaml"))
    assert written == load_cfg(opts=["OUT_DIR", str(tmp_path), *opts, "MODEL.NUM_CLASSES", "10"])
    assert written.MODEL.DUMMY_INPUT is True and written.TRAIN.IM_SIZE == 16
    # TensorBoard holds the same per-epoch scalars as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/top1", "val/images_per_s"} <= tags
    assert {f"val/top{val['k']}", f"train/top{val['k']}"} <= tags and "val/topk" not in tags, "a top-k tag names its k"
    assert not {"val/samples", "train/step", "train/samples"} & tags, "bookkeeping stays in metrics.jsonl"
    [point] = events.Scalars("val/top1")
    assert (point.step, point.value) == (1, pytest.approx(val["top1"]))


def test_flatten_gives_every_key_once_with_its_value():
    defaults = get_cfg_defaults()
    flat = flatten(defaults)
    assert flat["OPTIM.BASE_LR"] == defaults.OPTIM.BASE_LR and flat["TRAIN.BATCH_SIZE"] == defaults.TRAIN.BATCH_SIZE
    sections = [k for k, v in defaults.items() if isinstance(v, dict)]
    assert sum(len(flatten(defaults[s])) for s in sections) + len(defaults) - len(sections) == len(flat)


def test_config_diff_names_exactly_the_changed_keys_and_a_yaml_list_equals_a_yacs_tuple(tmp_path):
    opts = ["OPTIM.BASE_LR", "0.5", "TRAIN.BATCH_SIZE", "7", "OUT_DIR", str(tmp_path)]
    changed = load_cfg(opts=opts)
    dump_cfg(changed, str(tmp_path))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    defaults = get_cfg_defaults()
    expected = [("OPTIM.BASE_LR", defaults.OPTIM.BASE_LR, 0.5), ("OUT_DIR", defaults.OUT_DIR, str(tmp_path))]
    expected.append(("TRAIN.BATCH_SIZE", defaults.TRAIN.BATCH_SIZE, 7))
    assert config_diff(defaults, saved) == expected
    assert config_diff(saved, changed) == []
    assert config_changes(defaults, changed)[0] == f"OPTIM.BASE_LR: {defaults.OPTIM.BASE_LR!r} -> 0.5"
    # A value given as a tuple (yacs keeps what the command line's literal was) equals its YAML list.
    assert config_diff({"A": {"B": [1, 2]}}, {"A": {"B": (1, 2)}, "C": 3}) == [("C", None, 3)]


@pytest.mark.parametrize("world_size, accum", [(1, 1), (2, 4)])
def test_a_step_larger_than_a_ranks_share_of_the_data_is_one_line_naming_both_keys(world_size, accum):
    from distribuuuu.runtime.launcher import DistEnv
    from distribuuuu.training.inputs import build_train_split

    digits = str(REPO / "data" / "digits")
    per_rank = -(-1436 // world_size)  # DistributedSampler's share of the 1,436 training images
    batch = per_rank // accum + 1  # one more image than the share holds, per optimizer step
    cfg = load_cfg(opts=["TRAIN.DATASET", digits, "TRAIN.BATCH_SIZE", str(batch), "TRAIN.ACCUM_STEPS", str(accum)])
    with pytest.raises(ConfigError) as err:
        build_train_split(cfg, DistEnv(world_size=world_size))
    assert str(err.value) == (
        f"TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS ({batch * accum}) exceeds the {per_rank} training samples "
        f"each of {world_size} rank(s) gets"
    )
