"""A config built from the defaults, a YAML file and KEY VALUE pairs: read strictly (no alias, no key
given twice, bounded in size and depth; a Python file is never run), merged with yacs's type checks
(unknown keys named with a suggestion), validated and frozen; written back as YAML."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

import yaml
from yacs.config import CfgNode as CN

from distribuuuu.config.defaults import _C
from distribuuuu.config.keys import changes_from_defaults, flatten, get_key
from distribuuuu.config.rules import validate_cfg
from distribuuuu.config.values import clip, decode, shown, shown_key
from distribuuuu.errors import ConfigError, first_line


def load_cfg(cfg_file: str | None = None, opts: Sequence[str] = (), base: CN | None = None) -> CN:
    """Build a validated, frozen config from ``base`` (the defaults), a YAML file and KEY VALUE pairs."""
    config = (base or _C).clone()
    if cfg_file:
        _merge(config, _read_yaml(cfg_file), cfg_file)
    if len(opts) % 2:
        raise ConfigError(f"overrides must be KEY VALUE pairs, got an odd list: {shown(list(opts))}")
    pairs = {key: decode(value, f"command line: {key}") for key, value in zip(opts[0::2], opts[1::2])}
    _merge(config, _unflatten(pairs, "command line"), "command line")
    _resolve_nulls(config)
    validate_cfg(config)
    config.freeze()
    return config


def keys_given(cfg_file: str | None = None, opts: Sequence[str] = ()) -> set[str]:
    """The dotted keys a YAML file and KEY VALUE pairs set: what a user chose, where a key's default
    cannot tell (a value equal to the default may be chosen or not)."""
    given = set(flatten(_read_yaml(cfg_file))) if cfg_file else set()
    return given | {str(key) for key in opts[0::2]}


def _read_yaml(path: str) -> dict:
    """The mapping in a YAML file, or a ConfigError naming the file, the problem and its position."""
    if path.endswith(".py"):  # yacs's merge_from_file would run it (its _load_cfg_py_source): a config is data
        raise ConfigError(f"{path}: a Python file; configs are YAML, and no config file is ever run")
    try:
        text = _read_config_bytes(path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}{_configs_that_exist()}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it as YAML: {first_line(e)}") from None
    return _parse_yaml(text, path)


def stored_config(text: str, source: str) -> CN:
    """The config a checkpoint stored (its YAML text), read as strictly as a config file: a ConfigError
    naming ``source`` for an alias, a key given twice, a text too large or no mapping at all."""
    if not isinstance(text, str):  # weights_only loads give any plain value: a config is YAML text
        raise ConfigError(f"{source}: its stored config is a {type(text).__name__}, not YAML text")
    if len(text) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: its stored config is larger than 256 KiB, too large for a config")
    return CN(_parse_yaml(text, source))


def _parse_yaml(text: bytes | str, path: str) -> dict:
    """The mapping in YAML ``text`` (from ``path``, which messages name), read by ``_ConfigLoader``."""
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)
    except _Refused as e:
        raise ConfigError(f"{path}{e.where}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        context = f" ({e.context})" if e.context else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {e.problem}{context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: cannot read it as YAML: {first_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got a {type(data).__name__}")
    return data


# A config file is a small document a person writes (every key written out is ~3 KB): a far larger
# file is a mistake (a dataset or a checkpoint given as --cfg, /dev/zero), refused unread.
_MAX_CONFIG_BYTES = 256 * 1024
# SECTION: KEY: [list] is three levels; deeper is refused before PyYAML's recursive composer meets
# Python's recursion limit (a RecursionError traceback at ~1000 levels of "[").
_MAX_YAML_DEPTH = 16


def _read_config_bytes(path: str) -> bytes:
    """The file's bytes (PyYAML decodes them as YAML says: UTF-8, or UTF-16/32 with a BOM), or a
    ConfigError for a file too large to be a config."""
    with open(path, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than 256 KiB, too large for a config file (every key written out is ~3 KB)")
    return data


class _Refused(Exception):
    """What ``_ConfigLoader`` refuses, and where (``:line:column`` or ""); ``_read_yaml`` names the file."""

    def __init__(self, text: str, mark: yaml.Mark | None = None):
        super().__init__(text)
        self.where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, strict for config files: no aliases, no key given twice, bounded nesting,
    and PyYAML's own ValueErrors (a date with month 13) as a ``_Refused`` naming the line."""

    def __init__(self, stream: bytes | str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # Aliases are refused rather than bounded: an alias makes the document a graph, nine lists
        # of nine aliases each are 9**9 values in 330 bytes ("billion laughs", a MemoryError where
        # a message printed them), and no config of the original Distribuuuu or of config/ uses one.
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"YAML alias *{event.anchor}: a config file writes each value out", event.start_mark)
        self._depth += 1
        try:
            if self._depth > _MAX_YAML_DEPTH:
                raise _Refused(f"nested more than {_MAX_YAML_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _refuse_repeated_keys(node)
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as e:  # PyYAML's constructors: "2001-13-45", an int of 5,000 digits
            raise _Refused(f"cannot read {shown(node.value)}: {first_line(e)}", node.start_mark) from None


def _refuse_repeated_keys(node: yaml.Node, prefix: str = "") -> None:
    """Raise ``_Refused`` naming a key given twice in one mapping (PyYAML keeps the last silently) by
    its dotted path and both lines; a merge key (``<<``) too, which overrides keys as silently."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            raise _Refused("YAML merge key <<: a config file writes each key out", key_node.start_mark)
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # a list or a mapping as a key: the constructor refuses it (unhashable)
        key = f"{prefix}{shown_key(key_node.value)}"
        if (key_node.tag, key_node.value) in seen:
            first = seen[key_node.tag, key_node.value].start_mark
            raise _Refused(f"{key} given twice ({_two_places(first, key_node.start_mark)})")
        seen[key_node.tag, key_node.value] = key_node
        _refuse_repeated_keys(value_node, key + ".")


def _two_places(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line != second.line:
        return f"lines {first.line + 1} and {second.line + 1}"
    return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"


def _configs_that_exist() -> str:
    """Name the YAML files under this checkout's config/ (as paths to type from here), for a file not found."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folder = os.path.join(checkout, "config")
    found = sorted(
        os.path.join(root, name) for root, _, names in os.walk(folder) for name in names if name.endswith(".yaml")
    )
    shown = [p if os.path.relpath(p).startswith("..") else os.path.relpath(p) for p in found]
    return f"; the configs in this checkout: {', '.join(shown)}" if shown else ""


def _merge(config: CN, data: dict, source: str) -> None:
    """Merge nested ``data`` into ``config`` with yacs's type checks; unknown keys get a suggestion."""
    for key, value in flatten(data).items():
        if key not in _ALL_KEYS and key not in _C:  # a whole section given a value: yacs names the type
            raise ConfigError(f"{source}: {_unknown_key(key)}")
        decode(value, f"{source}: {key}")  # what yacs's literal_eval of each string would raise, named here
    widened = _widen_ints(data, _C)
    try:
        config.merge_from_other_cfg(CN(widened))
    except (KeyError, ValueError, AssertionError) as e:
        raise ConfigError(f"{source}: {_yacs_message(e, widened, source == 'command line')}") from None


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, _ALL_KEYS, n=1, cutoff=0.6)
    return f"unknown config key {shown_key(key)}" + (f": did you mean {close[0]}?" if close else "")


def merge_pairs(config: CN, pairs: dict[str, Any], source: str) -> None:
    """Merge flat ``KEY: value`` pairs into ``config`` (not frozen) with a config file's type checks."""
    _merge(config, _unflatten(pairs, source), source)


def _widen_ints(data: Any, defaults: Any) -> Any:
    """Ints where the default is a float become floats ("OPTIM.BASE_LR 1", "WARMUP_EPOCHS: 5"):
    yacs rejects them, and every user trips on that; every other type check stays strict."""
    if isinstance(data, dict) and isinstance(defaults, dict):
        return {k: _widen_ints(v, defaults.get(k)) for k, v in data.items()}
    if isinstance(defaults, float) and type(data) is int:
        return float(data)
    return data


def _unflatten(pairs: dict[str, Any], source: str) -> dict:
    """``{"OPTIM.BASE_LR": 0.1}`` -> ``{"OPTIM": {"BASE_LR": 0.1}}``; a key given a value and keys under it
    ("TRAIN 1 TRAIN.BATCH_SIZE 2") is a ConfigError."""
    nested: dict = {}
    for key, value in pairs.items():
        *sections, name = key.split(".")
        node = nested
        for depth, section in enumerate(sections, 1):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                section_key = ".".join(sections[:depth])
                raise ConfigError(
                    f"{source}: {shown_key(section_key)} is given a value and keys under it ({shown_key(key)})"
                )
        node[name] = value
    return nested


_ALL_KEYS = list(flatten(_C))


# Distribuuuu's own YAML files write these two keys as null: no weights, and an unseeded run
# (every run here is seeded, so null means the default seed).
_NULL_MEANS_DEFAULT = ("MODEL.WEIGHTS", "RNG_SEED")


def _resolve_nulls(config: CN, prefix: str = "") -> None:
    """Replace the nulls Distribuuuu wrote with their defaults; any other null is a ConfigError."""
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, CN):
            _resolve_nulls(value, key + ".")
        elif value is None:
            if key not in _NULL_MEANS_DEFAULT:
                raise ConfigError(f"{key} must have a value, got null")
            default = _C
            for part in key.split("."):
                default = default[part]
            config[name] = default


# yacs's type error: "Type mismatch (<class 'float'> vs. <class 'str'>) with values (VALUES) for config
# key: KEY". Only its types and key are read: VALUES holds the whole value given, any size.
_MISMATCH = re.compile(r"Type mismatch \(<class '(?:[\w.]*\.)?(\w+)'> vs\. <class '(?:[\w.]*\.)?(\w+)'>\)")
_KEY_IN_MISMATCH = " for config key: "
# yacs's KeyError for an unknown key under which ``data`` holds an empty mapping (flatten sees none)
_NON_EXISTENT = "Non-existent config key: "


def _yacs_message(e: Exception, data: dict, command_line: bool = False) -> str:
    """Rephrase yacs's errors so they lead with the key; a string given for a list says how to write one."""
    msg = str(e.args[0] if e.args else e)
    if msg.startswith(_NON_EXISTENT):
        return _unknown_key(msg[len(_NON_EXISTENT) :])
    mismatch = _MISMATCH.match(msg)
    if not mismatch or _KEY_IN_MISMATCH not in msg:
        return clip(msg.strip().partition("\n")[0], 300)
    want, got = mismatch.groups()
    key = msg.rpartition(_KEY_IN_MISMATCH)[2]
    value = get_key(data, key)
    hint = _list_hint(key, value, command_line) if want in ("list", "tuple") and got == "str" else ""
    want = "a section of keys" if want == "CfgNode" else want
    return f"{key} expects {want}, got {type(value).__name__} {shown(value)}{hint}"


def _list_hint(key: str, value: str, command_line: bool) -> str:
    """How to write the string ``value`` given for a list key as a list: each item quoted, in brackets."""
    items = [item.strip().strip("'\"") for item in value.strip("[]()").split(",") if item.strip()]
    as_list = shown(items)
    if command_line:  # the shell eats brackets and quotes: the whole list is one quoted argument
        return f'; write a list on the command line as {key} "{as_list}"'
    return f"; write a list in YAML as {key.rpartition('.')[2]}: {as_list}"


def run_config_changes(out_dir: str, cfg_dest: str = "config.yaml") -> list[tuple[str, Any, Any]]:
    """``changes_from_defaults`` of the config a run kept in OUT_DIR (none without one), read as
    strictly as any config file."""
    path = os.path.join(out_dir, cfg_dest)
    if not os.path.isfile(path):
        return []
    return changes_from_defaults(_read_yaml(path))


def dump_cfg(c: CN, out_dir: str) -> str:
    """Write the config as YAML to OUT_DIR/CFG_DEST and return its path."""
    path = os.path.join(out_dir, c.CFG_DEST)
    with open(path, "w") as f:
        f.write(c.dump())
    return path
