"""Config errors a user can act on: a missing file lists the configs that exist, a YAML syntax error
keeps its line and column, an unknown key suggests the key it resembles, ints widen to float keys."""

from __future__ import annotations

import re

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
