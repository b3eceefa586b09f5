"""Config errors a user can act on: a missing file lists the configs that exist, a YAML syntax error
keeps its line and column, an unknown key suggests the key it resembles, ints widen to float keys.
Hostile input (a huge value, a YAML alias bomb, a key given twice, infinity) is one short line, at
once, before OUT_DIR exists; fuzzed files and KEY VALUE pairs give a config or one such line."""

from __future__ import annotations

import re
import sys
import time

import pytest
from helpers import REPO, TRAIN, in_process, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distribuuuu.config import ConfigError, flatten, get_cfg_defaults, load_cfg
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


# ------------------------------------------------------------------------------------------------
# Strict config files: no alias, no key given twice, bounded nesting and size, never run as Python
# ------------------------------------------------------------------------------------------------
def _alias_bomb(levels: int = 9) -> str:
    """The "billion laughs" YAML under a real key: OPTIM.STEPS holds 9 ** levels ones in ~330 bytes."""
    names = "abcdefghi"[:levels]
    lines = ["OPTIM:", "  STEPS:", "  - &a [1,1,1,1,1,1,1,1,1]"]
    lines += [f"  - &{name} [{','.join([f'*{names[i]}'] * 9)}]" for i, name in enumerate(names[1:])]
    return "\n".join(lines) + "\n"


# A fresh interpreter, its address space capped at 4 GiB (a loader that expands the bomb fails with a
# MemoryError instead of taking the machine), prints the seconds load_cfg took, the peak of what it
# allocated in MiB (tracemalloc: ru_maxrss would keep the forked pytest's peak across exec) and its
# ConfigError; anything else is a traceback and exit 1.
_LOAD_BOUNDED = """
import resource, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
from distribuuuu.config import ConfigError, load_cfg
tracemalloc.start()
start = time.perf_counter()
try:
    load_cfg(sys.argv[1])
except ConfigError as e:
    print(f"{time.perf_counter() - start:.3f}", tracemalloc.get_traced_memory()[1] / 2**20, e, sep="\\n")
"""


def test_the_alias_bomb_is_refused_at_once_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert len(path.read_bytes()) < 400
    result = run([sys.executable, "-c", _LOAD_BOUNDED, str(path)], timeout=60)  # before: 70 s, a MemoryError
    assert result.returncode == 0, result.stderr[-3000:]
    seconds, peak_mib, message = result.stdout.splitlines()
    assert message == f"{path}:4:9: YAML alias *a: a config file writes each value out", message
    assert float(seconds) < 2, f"refused in {seconds} s"
    assert float(peak_mib) < 4, f"{peak_mib} MiB allocated to refuse {len(path.read_bytes())} bytes"


@pytest.mark.parametrize(
    "text, said",
    [
        ("TRAIN:\n  BATCH_SIZE: &batch 16\nTEST:\n  BATCH_SIZE: *batch\n", ":4:15: YAML alias *batch: a config file writes each value out"),
        ("TRAIN: {<<: {BATCH_SIZE: 8}, TOPK: 3}\n", ":1:9: YAML merge key <<: a config file writes each key out"),
        ("TRAIN:\n  BATCH_SIZE: 8\nOPTIM:\n  BASE_LR: 0.1\nTRAIN:\n  TOPK: 3\n", ": TRAIN given twice (lines 1 and 5)"),
        ("TRAIN:\n  BATCH_SIZE: 8\n  TOPK: 3\n  BATCH_SIZE: 16\n", ": TRAIN.BATCH_SIZE given twice (lines 2 and 4)"),
        ("OUT_DIR: a\nRNG_SEED: 3\nOUT_DIR: b\n", ": OUT_DIR given twice (lines 1 and 3)"),
        ("TRAIN: {BATCH_SIZE: 8, BATCH_SIZE: 16}\n", ": TRAIN.BATCH_SIZE given twice (line 1, columns 9 and 24)"),
    ],
    ids=["alias", "merge-key", "section-twice", "nested-key-twice", "top-level-key-twice", "twice-on-one-line"],
)  # fmt: skip
def test_an_alias_or_a_key_given_twice_is_refused_naming_the_file_and_the_lines(tmp_path, text, said):
    message, path = _refusal(tmp_path, text)
    assert message == f"{path}{said}"


@pytest.mark.parametrize(
    "text, said",
    [
        ("OUT_DIR: 2001-13-45\n", ":1:10: cannot read '2001-13-45': month must be in 1..12"),
        ("TRAIN:\n  BATCH_SIZE: " + "1" * 5000 + "\n", ":2:15: cannot read '1111"),
        ("OUT_DIR: " + "[" * 3000 + "]" * 3000 + "\n", ":1:25: nested more than 16 levels deep"),
        ("OUT_DIR: " + "-" * 3000 + "1\n", ": OUT_DIR: cannot read '-----"),  # yacs's literal_eval of the string
        ('"TRAIN\\nX": 1\n', ": unknown config key 'TRAIN\\nX'"),
        ("TRAIN: null\n", ": TRAIN expects a section of keys, got NoneType None"),
    ],
    ids=["month-13", "int-of-5000-digits", "nested-3000-deep", "literal-nested-3000-deep", "newline-in-key",
         "section-null"],
)  # fmt: skip
def test_a_value_pyyaml_or_yacs_cannot_read_is_one_line_naming_the_file(tmp_path, text, said):
    # Each was a traceback (ValueError, RecursionError) or a message of several lines before.
    message, path = _refusal(tmp_path, text)
    assert message.startswith(f"{path}{said}") and "\n" not in message and len(message) < 400, message


def test_a_config_file_larger_than_any_config_is_refused_unread(tmp_path):
    message, path = _refusal(tmp_path, "# " + "x" * 2**20 + "\n")
    assert message == f"{path}: larger than 256 KiB, too large for a config file (every key written out is ~3 KB)"


# ------------------------------------------------------------------------------------------------
# Every float finite; the number lists hold finite numbers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, said",
    [
        ("OPTIM:\n  BASE_LR: .inf\n", "OPTIM.BASE_LR must be finite, got inf"),
        ("OPTIM:\n  BASE_LR: 1.0e+999\n", "OPTIM.BASE_LR must be finite, got inf"),
        ("OPTIM:\n  BASE_LR: 1e999\n", "OPTIM.BASE_LR must be finite, got inf"),  # a YAML string yacs reads as a literal
        ("OPTIM:\n  WEIGHT_DECAY: .nan\n", "OPTIM.WEIGHT_DECAY must be finite, got nan"),
        ("DIST:\n  LOCK_STALE_S: .inf\n", "DIST.LOCK_STALE_S must be finite, got inf"),
        ("DATA:\n  MEAN: [0.5, .nan, 0.5]\n", "DATA.MEAN must hold finite numbers, got [0.5, nan, 0.5]"),
        ("OPTIM:\n  LR_POLICY: steps\n  STEPS: [10, .inf]\n", "OPTIM.STEPS must hold finite numbers, got [10, inf]"),
        ("DATA:\n  MEAN: [a, b, c]\n", "DATA.MEAN must hold finite numbers, got ['a', 'b', 'c']"),  # was accepted
        ("DATA:\n  STD: [a, b, c]\n", "DATA.STD must hold finite numbers, got ['a', 'b', 'c']"),  # was a TypeError
        ("OPTIM:\n  BETAS: [0.9, [0.99]]\n", "OPTIM.BETAS must hold finite numbers, got [0.9, [0.99]]"),
        ("OPTIM:\n  BETAS: [0.9, true]\n", "OPTIM.BETAS must hold finite numbers, got [0.9, True]"),
    ],
)  # fmt: skip
def test_a_non_finite_float_or_a_non_number_in_a_number_list_in_a_file_is_refused_naming_its_key(tmp_path, text, said):
    assert _refusal(tmp_path, text)[0] == said


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("OPTIM.BASE_LR", "1e999", "must be finite, got inf"),
        ("DIST.LOCK_WAIT_S", "1e999", "must be finite, got inf"),
        ("OPTIM.MIN_LR", "-1e999", "must be finite, got -inf"),
        ("DATA.STD", "[0.2, 1e999, 0.2]", "must hold finite numbers, got [0.2, inf, 0.2]"),
        ("OPTIM.BETAS", "(0.9, -1e999)", "must hold finite numbers, got [0.9, -inf]"),
    ],
)
def test_a_non_finite_float_on_the_command_line_is_refused_naming_its_key(key, value, said):
    with pytest.raises(ConfigError) as err:
        load_cfg(None, [key, value])
    assert str(err.value) == f"{key} {said}"


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_nan_and_inf_on_the_command_line_are_strings_a_float_key_refuses(value):
    # ast.literal_eval reads no name: "nan" stays a string, and yacs's type check names the key.
    with pytest.raises(ConfigError, match=rf"^command line: OPTIM.BASE_LR expects float, got str '{value}'$"):
        load_cfg(None, ["OPTIM.BASE_LR", value])


# ------------------------------------------------------------------------------------------------
# Hostile input through tools/train_net.py: one line, exit 2, OUT_DIR never made
# ------------------------------------------------------------------------------------------------
HOSTILE = {
    # id: (config file text or None, KEY VALUE pairs, what the one line says)
    "alias-bomb": (_alias_bomb(), [], "YAML alias *a"),
    "key-given-twice": ("TRAIN:\n  BATCH_SIZE: 8\nTRAIN:\n  TOPK: 3\n", [], "TRAIN given twice (lines 1 and 3)"),
    "inf-in-a-file": ("OPTIM:\n  BASE_LR: .inf\n", [], "OPTIM.BASE_LR must be finite, got inf"),
    "inf-on-the-command-line": (None, ["OPTIM.BASE_LR", "1e999"], "OPTIM.BASE_LR must be finite, got inf"),
    "huge-value": (None, ["OPTIM.STEPS", "[" + "0, " * HUGE + "]"], "OPTIM.STEPS: a value of 3,000,002 characters"),
    "long-value": (None, ["OPTIM.STEPS", "[" + "0, " * LONG + "]"], "OPTIM.STEPS must be a list of ascending"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_config_input_stops_train_net_in_one_line_with_exit_2_before_out_dir_exists(case, tmp_path):
    text, opts, said = HOSTILE[case]
    cfg_args = []
    if text is not None:
        (tmp_path / "exp.yaml").write_text(text)
        cfg_args = ["--cfg", str(tmp_path / "exp.yaml")]
    out_dir = tmp_path / "out"
    result = in_process(TRAIN, *cfg_args, "OUT_DIR", str(out_dir), *opts)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distribuuuu: error: ") and said in lines[0], result.stderr[-3000:]
    assert len(lines[0]) < 400
    assert not out_dir.exists(), "nothing written"


# ------------------------------------------------------------------------------------------------
# Fuzzed: any config file and any KEY VALUE strings give a config or one ConfigError line
# ------------------------------------------------------------------------------------------------
_KEYS = sorted(flatten(get_cfg_defaults())) + sorted(k for k, v in get_cfg_defaults().items() if isinstance(v, dict))
# Scalars as YAML or the command line writes them, the awkward ones included
_ODD_SCALARS = [
    ".inf", "-.inf", ".nan", "1e999", "1.0e+999", "nan", "~", "null", "true", "no", "0x1f", "0o17", "1_000",
    "2001-13-45", "2001-12-14", "'1e999'", '"[1, 2]"', "1" * 5000, "-" * 3000 + "1", "1" + "+1" * 3000, "{}", "[]",
    "!!binary aGk=", "!!set {a}", "!!python/object:os.system x", "|\n  x", "'a\\nb'", '"\\x00"',
]  # fmt: skip


def _mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` seven draws in eight, ``rare`` the eighth: the examples reach the rules, not only the parser."""
    return st.integers(0, 7).flatmap(lambda n: rare if n == 0 else usual)


_PRINTABLE = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")), max_size=12)
_ANY_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_SCALAR_TEXT = st.one_of(
    st.sampled_from(_ODD_SCALARS),
    st.integers(-(10**20), 10**20).map(str),
    st.floats().map(repr),
    _mostly(_PRINTABLE, _ANY_TEXT),
)
_KEY_TEXT = _mostly(st.sampled_from(_KEYS), _mostly(_PRINTABLE, _ANY_TEXT))


@st.composite
def _yaml_ish(draw) -> str:
    """Sections of known (sometimes unknown, repeated) keys with scalars, flow lists, anchors and aliases."""
    anchors: list[str] = []

    def value() -> str:
        kind = draw(st.sampled_from(["scalar", "list", "nested", "anchor", "alias"]))
        if kind == "alias" and anchors:
            return f"*{draw(st.sampled_from(anchors))}"
        if kind == "anchor":
            anchors.append(f"a{len(anchors)}")
            return f"&{anchors[-1]} [{', '.join(draw(st.lists(_SCALAR_TEXT, max_size=4)))}]"
        if kind == "list":
            return f"[{', '.join(draw(st.lists(_SCALAR_TEXT, max_size=4)))}]"
        if kind == "nested":
            return "[" * draw(st.integers(1, 20)) + draw(_SCALAR_TEXT) + "]" * draw(st.integers(0, 20))
        return draw(_SCALAR_TEXT)

    lines = []
    for key in draw(st.lists(_KEY_TEXT, min_size=1, max_size=8)):
        section, _, name = key.rpartition(".")
        lines += [f"{section}:", f"  {name}: {value()}"] if section else [f"{key}: {value()}"]
    return "\n".join(lines) + "\n"


# 150 examples a test, each within a 1 s deadline (an example takes milliseconds: a loader that
# expanded its input would overrun it), no example database (nothing written into the checkout):
# 0.5-3 s a test on the 2-vCPU EPYC. 5,000 examples a test found nothing more.
_FUZZ = settings(max_examples=150, deadline=1000, database=None, suppress_health_check=[HealthCheck.too_slow])


def _load_or_config_error(cfg_file: str | None, opts: list[str], given: int) -> None:
    """load_cfg gives a config no larger than its input allows, or a ConfigError of one short line."""
    try:
        cfg = load_cfg(cfg_file, opts)
    except ConfigError as e:
        assert "\n" not in str(e) and len(str(e)) < 600, str(e)[:2000]
    else:  # a value dumps to a few times its text at most (YAML escapes a byte in 4); an alias, to any multiple
        assert len(cfg.dump()) <= len(get_cfg_defaults().dump()) + 8 * given, "no value much larger than its text"


@_FUZZ
@given(data=st.one_of(st.binary(max_size=600), _yaml_ish().map(str.encode)))
def test_fuzzed_config_files_load_or_give_one_config_error_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz", numbered=True) / "exp.yaml"
    path.write_bytes(data)
    _load_or_config_error(str(path), [], len(data))


@_FUZZ
@given(pairs=st.lists(st.tuples(_KEY_TEXT, _SCALAR_TEXT), max_size=4))
def test_fuzzed_command_line_pairs_load_or_give_one_config_error_line(pairs):
    opts = [text for pair in pairs for text in pair]
    _load_or_config_error(None, opts, sum(len(t) for t in opts))
