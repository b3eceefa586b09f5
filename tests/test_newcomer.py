"""What a newcomer tripped over (issue 12): YAML errors with their position, "did you mean",
a finished run that says so, a best.pth.tar that holds only what evaluation needs."""

from __future__ import annotations

import pytest
from helpers import FAST, TRAIN, assert_ok, python, read_metrics, run

from distribuuuu import checkpoint as ckpt
from distribuuuu.config import ConfigError, load_cfg


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("TRAIN:\n  BATCH_SIZE: 16\n    IM_SIZE: 32\n", ":3:12:", "mapping values are not allowed here"),
        ("OPTIM:\n  STEPS: [30, 60\nTRAIN: {}\n", ":3:6:", "expected ',' or ']'"),
        ("MODEL:\n\tARCH: resnet18\n", ":2:1:", "found character '\\t' that cannot start any token"),
    ],
)
def test_a_yaml_syntax_error_keeps_the_problem_and_its_line_and_column(tmp_path, text, where, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_cfg(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}{where} YAML syntax error: ") and problem in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    "source, key, suggestion",
    [("cli", "TRAIN.BACTH_SIZE", "TRAIN.BATCH_SIZE"), ("yaml", "OPTIM.BASE_RL", "OPTIM.BASE_LR")],
)
def test_an_unknown_key_suggests_the_key_it_resembles(tmp_path, source, key, suggestion):
    if source == "cli":
        args: tuple = (None, [key, "8"])
    else:
        section, name = key.split(".")
        (tmp_path / "typo.yaml").write_text(f"{section}:\n  {name}: 8\n")
        args = (str(tmp_path / "typo.yaml"),)
    with pytest.raises(ConfigError, match=rf"unknown config key {key}: did you mean {suggestion}\?$"):
        load_cfg(*args)


def test_an_unknown_key_like_no_other_gets_no_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key TOTALLY.UNRELATED$"):
        load_cfg(None, ["TOTALLY.UNRELATED", "1"])


def test_ints_widen_to_float_keys_from_a_file_and_the_command_line_but_not_to_strings(tmp_path):
    (tmp_path / "ints.yaml").write_text("OPTIM:\n  BASE_LR: 1\n  WARMUP_EPOCHS: 0\n")
    cfg = load_cfg(str(tmp_path / "ints.yaml"), ["OPTIM.MIN_LR", "0"])
    assert (cfg.OPTIM.BASE_LR, cfg.OPTIM.WARMUP_EPOCHS, cfg.OPTIM.MIN_LR) == (1.0, 0.0, 0.0)
    assert all(type(v) is float for v in (cfg.OPTIM.BASE_LR, cfg.OPTIM.WARMUP_EPOCHS, cfg.OPTIM.MIN_LR))
    with pytest.raises(ConfigError, match="MODEL.ARCH expects str, got int"):
        load_cfg(None, ["MODEL.ARCH", "18"])


@pytest.mark.slow
def test_a_finished_run_says_so_and_best_holds_only_what_evaluation_needs(tmp_path):
    args = ["OUT_DIR", str(tmp_path), *FAST, "OPTIM.MAX_EPOCH", "1"]
    assert_ok(run(python(TRAIN, *args), timeout=300))
    again = run(python(TRAIN, *args), timeout=300)
    assert_ok(again)
    lines = [line for line in again.stdout.splitlines() if "already holds a finished run" in line]
    assert len(lines) == 1 and "another OUT_DIR" in lines[0] and "OPTIM.MAX_EPOCH" in lines[0], again.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path) if r["split"] == "train"] == [1]  # nothing trained
    best = ckpt.load_checkpoint(str(tmp_path / ckpt.BEST_NAME))
    last = ckpt.load_checkpoint(str(tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)))
    assert set(best) == {"model", "ema", "epoch", "best_acc1", "best_weights", "classes", "arch", "cfg", "checksum"}
    assert all(best["model"][k].equal(v) for k, v in last["model"].items())
    assert (tmp_path / ckpt.BEST_NAME).stat().st_size < 0.6 * (
        tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(1)
    ).stat().st_size
