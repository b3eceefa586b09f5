"""The public toolbox for other scripts: ``from distribuuuu import utils``. Re-exports only."""

from distribuuuu.checkpointing.checkpoint import load_checkpoint, save_checkpoint
from distribuuuu.models import count_parameters, register_model, unwrap_model
from distribuuuu.records.meters import AverageMeter, MetricSums, accuracy, topk_correct
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import (
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
