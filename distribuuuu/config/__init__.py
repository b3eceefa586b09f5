"""Configuration: every key with its default (``defaults``), its rule (``rules``), loading a config
from a YAML file and KEY VALUE pairs (``load``), dotted keys and the diff of two configs (``keys``),
and how a value is read and shown (``values``). The only place that knows yacs; the rest of the
package takes the config at the boundary where a run is set up (``training/``) and passes
explicit arguments below it.
"""

from distribuuuu.config.defaults import (
    AUTO_AUGMENTS,
    BEST_METRICS,
    CKPT_FORMATS,
    COMM_HOOKS,
    DECODERS,
    INTERPOLATIONS,
    LR_POLICIES,
    OPTIMIZERS,
    PRECISIONS,
    SAMPLERS,
    STRATEGIES,
    TASKS,
    TRACKERS,
    get_cfg_defaults,
)
from distribuuuu.config.keys import changes_from_defaults, config_changes, config_diff, flatten, get_key
from distribuuuu.config.load import dump_cfg, keys_given, load_cfg, merge_pairs, run_config_changes, stored_config
from distribuuuu.config.rules import parse_model_kwargs, validate_cfg
from distribuuuu.errors import ConfigError

__all__ = [
    "AUTO_AUGMENTS",
    "BEST_METRICS",
    "CKPT_FORMATS",
    "COMM_HOOKS",
    "DECODERS",
    "INTERPOLATIONS",
    "LR_POLICIES",
    "OPTIMIZERS",
    "PRECISIONS",
    "SAMPLERS",
    "STRATEGIES",
    "TASKS",
    "TRACKERS",
    "ConfigError",
    "changes_from_defaults",
    "config_changes",
    "config_diff",
    "dump_cfg",
    "flatten",
    "get_cfg_defaults",
    "get_key",
    "keys_given",
    "load_cfg",
    "merge_pairs",
    "parse_model_kwargs",
    "run_config_changes",
    "stored_config",
    "validate_cfg",
]
