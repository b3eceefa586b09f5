"""MODEL.NUM_CLASSES decided once: the config's, or, left at its default (0), the training data's.

0 is the default because a default count (the digits' 10) could not tell "10 set on purpose" from
"not set": three class folders trained a 10-way head that predict.py then refused. A YAML file or
command line that sets a count keeps it (the original Distribuuuu's files set 1000), and a set
count the data disagrees with stays the warning or error it was. The run's config carries the
count it took, so its checkpoints and OUT_DIR/config.yaml store it.
"""

from __future__ import annotations

from yacs.config import CfgNode

from distribuuuu.config import ConfigError, get_cfg_defaults, validate_cfg
from distribuuuu.logger import get_logger

logger = get_logger("data")

FROM_THE_DATA = 0  # MODEL.NUM_CLASSES's default: the training data's class count
DUMMY_CLASSES = 10  # MODEL.DUMMY_INPUT's synthetic classes when the count is left to the data
LEGACY_CLASSES = 10  # the default before it was taken from the data: weights that name neither classes nor config


def with_class_count(cfg: CfgNode, count: int) -> CfgNode:
    """``cfg`` with MODEL.NUM_CLASSES ``count`` where it is left to the data, validated and frozen;
    otherwise ``cfg`` itself. TRAIN.TOPK at its default (5) is lowered to a smaller count; one set
    above the count is the rules' error, naming TRAIN.TOPK, as with a count set on purpose."""
    if cfg.MODEL.NUM_CLASSES != FROM_THE_DATA:
        return cfg
    resolved = cfg.clone()
    resolved.defrost()
    resolved.MODEL.NUM_CLASSES = count
    if resolved.TRAIN.TOPK == get_cfg_defaults().TRAIN.TOPK:
        resolved.TRAIN.TOPK = min(resolved.TRAIN.TOPK, count)
    try:
        validate_cfg(resolved)
    except ConfigError as e:
        raise ConfigError(f"{e} (MODEL.NUM_CLASSES {count}: the training data's count)") from None
    resolved.freeze()
    return resolved


def take_class_count(cfg: CfgNode, count: int, where: str) -> CfgNode:
    """``with_class_count``, said in the log: how many classes, from where (``where``: the split's folder or file)."""
    resolved = with_class_count(cfg, count)
    if resolved is not cfg:
        lowered = f"; TRAIN.TOPK {cfg.TRAIN.TOPK} lowered to {count}" if resolved.TRAIN.TOPK != cfg.TRAIN.TOPK else ""
        logger.info(
            "MODEL.NUM_CLASSES left to the data: %d classes, from %s (stored with the run; set MODEL.NUM_CLASSES "
            "for another head)%s", count, where, lowered,
        )  # fmt: skip
    return resolved
