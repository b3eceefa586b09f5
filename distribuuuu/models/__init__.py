"""Models: the zoo (torchvision by name, timm, user-registered), their anatomy (blocks, BatchNorm,
wrappers) and loading whole weights into them. Knows nothing of the config: the run's set-up
translates MODEL.* into arguments (``training/parallelize.py``)."""

from distribuuuu.models.anatomy import (
    count_parameters,
    enable_activation_checkpointing,
    enable_grad_checkpointing,
    find_blocks,
    has_batchnorm,
    model_num_classes,
    named_blocks,
    unwrap_model,
    zero_init_residual,
)
from distribuuuu.models.weights import WeightsFit, load_model_weights, versioned, weights_fit
from distribuuuu.models.zoo import (
    NotFetched,
    build_model,
    model_source,
    register_model,
    timm_pretrained_cfg,
    torchvision_weights,
)

__all__ = [
    "NotFetched",
    "build_model",
    "count_parameters",
    "enable_activation_checkpointing",
    "enable_grad_checkpointing",
    "find_blocks",
    "has_batchnorm",
    "load_model_weights",
    "model_num_classes",
    "model_source",
    "named_blocks",
    "register_model",
    "timm_pretrained_cfg",
    "torchvision_weights",
    "unwrap_model",
    "versioned",
    "weights_fit",
    "WeightsFit",
    "zero_init_residual",
]
