"""Dotted config keys: the one flattener (``TRAIN.BATCH_SIZE``), a key's value, and the diff of two
configs (what a resume logs and a summary lists)."""

from __future__ import annotations

from typing import Any

from distribuuuu.config.defaults import get_cfg_defaults


def flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """``{"TRAIN": {"BATCH_SIZE": 32}}`` -> ``{"TRAIN.BATCH_SIZE": 32}``; a CfgNode is a dict too."""
    flat: dict[str, Any] = {}
    for name, value in node.items():
        key = f"{prefix}{name}"
        flat.update(flatten(value, key + ".") if isinstance(value, dict) else {key: value})
    return flat


def config_diff(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key of ``new`` whose value differs in ``old``, sorted by key.

    Both are nested (a CfgNode or a YAML file's dict); a key ``old`` lacks has None there. A tuple
    and a list with the same items are equal: yacs keeps tuples, YAML reads lists.
    """
    before = flatten(old)
    return [(k, before.get(k), v) for k, v in sorted(flatten(new).items()) if _plain(before.get(k)) != _plain(v)]


def config_changes(saved: dict, current: dict) -> list[str]:
    """``KEY: old -> new`` for every key of ``current`` whose value differs in ``saved`` (what a resume logs)."""
    return [f"{key}: {old!r} -> {value!r}" for key, old, value in config_diff(saved, current)]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def get_key(config: dict, key: str) -> Any:
    """The value of the dotted ``key`` in the nested ``config``."""
    for part in key.split("."):
        config = config[part]
    return config


def changes_from_defaults(config: dict) -> list[tuple[str, Any, Any]]:
    """(key, default, value) for every key of ``config`` (a CfgNode, or a config.yaml's dict) that
    differs from the defaults: what a run summary lists."""
    return config_diff(get_cfg_defaults(), config)
