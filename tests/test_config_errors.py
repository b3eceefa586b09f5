"""Config errors a user can act on: a missing file lists the configs that exist, a YAML syntax error
keeps its line and column, an unknown key suggests the key it resembles, ints widen to float keys."""

from __future__ import annotations

import re
import time

import pytest
from helpers import REPO

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.models import model_source


def test_a_config_file_not_found_lists_the_configs_that_exist(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_cfg("config/resnet19.yaml")
    message = str(err.value)
    assert message.startswith("config file not found: config/resnet19.yaml; the configs in this checkout: ")
    listed = message.split("; the configs in this checkout: ")[1].split(", ")
    assert sorted(listed) == sorted(str(p.relative_to(REPO)) for p in (REPO / "config").rglob("*.yaml"))
    assert "config/resnet18.yaml" in listed and "\n" not in message


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


@pytest.mark.parametrize("given", ["conv1.*", "[conv1.*]"])
def test_a_string_for_a_list_key_on_the_command_line_shows_the_quoted_list_syntax(given):
    with pytest.raises(ConfigError) as raised:
        load_cfg(None, ["MODEL.FREEZE", given])
    assert str(raised.value).endswith("""MODEL.FREEZE "['conv1.*']\""""), str(raised.value)
    assert "MODEL.FREEZE expects list" in str(raised.value)
    assert load_cfg(None, ["MODEL.FREEZE", "['conv1.*']"]).MODEL.FREEZE == ["conv1.*"], "the shown syntax works"


def test_a_string_for_a_list_key_in_yaml_shows_the_yaml_list(tmp_path):
    (tmp_path / "freeze.yaml").write_text("MODEL:\n  FREEZE: conv1.*\n")
    with pytest.raises(
        ConfigError, match=r"MODEL.FREEZE expects list.*write a list in YAML as FREEZE: \['conv1.\*'\]$"
    ):
        load_cfg(str(tmp_path / "freeze.yaml"))


@pytest.mark.parametrize(
    "arch, said", [("resnet1888", ": did you mean resnet18?"), ("vitb16", ": did you mean vit_b_16?"), ("qqqq", ")")]
)
def test_an_unknown_architecture_suggests_the_model_it_resembles(arch, said):
    with pytest.raises(ConfigError, match=rf"^MODEL.ARCH: unknown model '{arch}' \(.*{re.escape(said)}$"):
        model_source(arch)


def _refusal(tmp_path, text: str) -> tuple[str, str]:
    """The ConfigError that ``text`` as a config file gets, and the file's path."""
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_cfg(str(path))
    return str(err.value), str(path)


# ------------------------------------------------------------------------------------------------
# A message shows a value cut short: no message grows with the value, no value is read at any length
# ------------------------------------------------------------------------------------------------
LONG = 10_000  # items: under the 64 KiB a value may have, 30 KB of text a message must not print


@pytest.mark.parametrize(
    "opts, names",
    [
        (["OPTIM.STEPS", "[" + "0, " * LONG + "]"], "OPTIM.STEPS must be a list of ascending positive epochs"),
        (["OPTIM.BASE_LR", "[" + "1, " * LONG + "]"], "command line: OPTIM.BASE_LR expects float, got list [1,"),
        (["MODEL.FREEZE", "a," * LONG], 'write a list on the command line as MODEL.FREEZE "'),
        (["MODEL.KWARGS", "['" + "x" * LONG + "']"], 'MODEL.KWARGS must be a list of "name=value" strings'),
        (["TRAIN." + "X" * 10**6, "1"], "command line: unknown config key TRAIN.XXX"),
        (["TRAIN.BATCH_SIZE", "8", "x" * 10**6], "overrides must be KEY VALUE pairs"),
        (["OUT_DIR", "-" * 3000 + "1"], "command line: OUT_DIR: cannot read '-----"),  # was a RecursionError
    ],
    ids=["rule", "type-mismatch", "list-hint", "kwargs", "unknown-key", "odd-list", "nested-too-deeply"],
)
def test_a_long_value_gets_a_short_message(opts, names):
    with pytest.raises(ConfigError) as err:
        load_cfg(None, opts)
    message = str(err.value)
    assert names in message and len(message) < 300 and "\n" not in message, message[:1000]


def test_a_long_list_in_a_file_gets_a_short_message(tmp_path):
    message, path = _refusal(tmp_path, "OPTIM:\n  BASE_LR: [" + "1, " * 5000 + "]\n")
    assert message.startswith(f"{path}: OPTIM.BASE_LR expects float, got list [1, 1,"), message[:1000]
    assert len(message) < 300, message[:1000]


HUGE = 10**6  # items of OPTIM.STEPS


def test_a_huge_value_is_refused_at_once_by_its_length():
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_cfg(None, ["OPTIM.STEPS", "[" + "0, " * HUGE + "]"])
    seconds = time.perf_counter() - start
    assert str(err.value) == (
        "command line: OPTIM.STEPS: a value of 3,000,002 characters is too long for a config value (at most 64 KiB)"
    )
    assert seconds < 2, f"{seconds:.1f} s to refuse a {HUGE}-item value"


@pytest.mark.parametrize(
    "opts, said",
    [
        (["TRAIN", "1", "TRAIN.BATCH_SIZE", "2"], "TRAIN is given a value and keys under it (TRAIN.BATCH_SIZE)"),
        (["TRAIN.BATCH_SIZE", "2", "TRAIN", "1"], "TRAIN expects a section of keys, got int 1"),
        (["TRAIN.BACTH_SIZE", "{}"], "unknown config key TRAIN.BACTH_SIZE: did you mean TRAIN.BATCH_SIZE?"),
        (["", "{}"], "unknown config key ''"),
    ],
    ids=["value-then-keys", "keys-then-value", "empty-mapping", "empty-key"],
)
def test_a_section_given_a_value_or_an_unknown_key_an_empty_mapping_is_one_line(opts, said):
    # Found by the fuzz tests below: a TypeError traceback, and yacs's own "Non-existent config key".
    with pytest.raises(ConfigError) as err:
        load_cfg(None, opts)
    assert str(err.value) == f"command line: {said}"
