"""The public toolbox for other scripts: ``from distribuuuu import utils``. Re-exports only."""

from distribuuuu.checkpoint import load_checkpoint, save_checkpoint
from distribuuuu.distributed import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
    broadcast_object,
    cleanup_distributed,
    get_local_rank,
    get_rank,
    get_world_size,
    is_main_process,
    scaled_all_reduce,
    setup_distributed,
)
from distribuuuu.launch import DistEnv
from distribuuuu.meters import AverageMeter, MetricSums, accuracy, topk_correct
from distribuuuu.models import count_parameters, register_model, unwrap_model

__all__ = [
    "AverageMeter",
    "DistEnv",
    "MetricSums",
    "accuracy",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "broadcast_buffers",
    "broadcast_object",
    "cleanup_distributed",
    "count_parameters",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "load_checkpoint",
    "register_model",
    "save_checkpoint",
    "scaled_all_reduce",
    "setup_distributed",
    "topk_correct",
    "unwrap_model",
]
