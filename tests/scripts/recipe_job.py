"""The worker of tests/integration/test_recipe_runs.py: ``python tests/scripts/recipe_job.py train|test
KEY VALUE ...`` runs train_net.py's / test_net.py's entry point unchanged, with the tiny model of
tests/recipe_helpers.py registered and counters (optimizer steps, DDP gradient all-reduces,
optimizer-state elements on this rank, logits dtypes) written to ``OUT_DIR/stats_<mode>.rank<R>.json``.
Training argument lists separated by ``--then`` train one after another in one process group: several
runs, one launch. Run in a process of its own or by helpers.in_process (each run a fresh ``STATS``).
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

from recipe_helpers import RecipeCNN  # noqa: E402
from torch import nn  # noqa: E402

from distribuuuu import cli, trainer  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402
from distribuuuu.models import register_model  # noqa: E402
from distribuuuu.runtime.process_group import cleanup_distributed  # noqa: E402
from distribuuuu.training import parallelize  # noqa: E402

# Filled by the worker's hooks, written out when the worker exits.
STATS: dict = {"steps": 0, "allreduces": 0, "state_elements": [], "param_dtypes": [], "logits_dtypes": [], "ema": []}


def _record_logits_dtype(module: nn.Module, inputs, output: torch.Tensor) -> None:
    if module.training and str(output.dtype) not in STATS["logits_dtypes"]:
        STATS["logits_dtypes"].append(str(output.dtype))


@register_model("recipe_cnn")
def recipe_cnn(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    model = RecipeCNN(num_classes)
    model.register_forward_hook(_record_logits_dtype)
    return model


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------
def _counting_allreduce_hook(state: dict, bucket):
    """DDP comm hook: count the bucket all-reduces, then do DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state["allreduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _local_state_elements(optimizer: torch.optim.Optimizer) -> int:
    """Tensor elements of optimizer state held by this rank (ZeRO's local shard, if sharded)."""
    local = getattr(optimizer, "optim", optimizer)
    return sum(v.numel() for s in local.state.values() if s for v in s.values() if torch.is_tensor(v) and v.ndim)


def _install_counters() -> None:
    """Wrap the trainer's DDP wrap and optimizer step with counters."""
    wrap_model, optimizer_step = parallelize.wrap_model, trainer.optimizer_step

    def counting_wrap(model, cfg, env):
        wrapped = wrap_model(model, cfg, env)
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(STATS, _counting_allreduce_hook)
        return wrapped

    def counting_step(run, sums):
        if not STATS["steps"]:  # optimizer state before the first step: what a resume loaded
            STATS["state_elements_at_start"] = _local_state_elements(run.optimizer)
        optimizer_step(run, sums)
        STATS["steps"] += 1
        STATS["state_elements"].append(_local_state_elements(run.optimizer))
        for dtype in {str(p.dtype) for p in run.model.parameters()} - set(STATS["param_dtypes"]):
            STATS["param_dtypes"].append(dtype)
        if run.ema is not None:
            STATS["ema"] = torch.cat([v.double().flatten() for v in run.ema.module.state_dict().values()]).tolist()

    parallelize.wrap_model, trainer.optimizer_step = counting_wrap, counting_step


def worker(mode: str, argv: list[str]) -> int:
    """Run train_net.py's (``train``) or test_net.py's (``test``) entry point with counters."""
    _install_counters()
    if "--then" not in argv:
        code = cli.run_tool(trainer.train_model if mode == "train" else trainer.test_model, argv)
        _write_stats(argv, mode)
        return code
    try:  # several runs in the process group the first one starts (train_model's cleanup=False)
        for is_separator, group in itertools.groupby(argv, lambda arg: arg == "--then"):
            if not is_separator:
                args = list(group)
                STATS.update(steps=0, allreduces=0, state_elements=[], param_dtypes=[], logits_dtypes=[], ema=[])
                trainer.train_model(load_cfg(None, args), cleanup=False)
                _write_stats(args, mode)
    finally:
        cleanup_distributed()
    return 0


def _write_stats(argv: list[str], mode: str) -> None:
    out_dir = argv[argv.index("OUT_DIR") + 1]
    with open(os.path.join(out_dir, f"stats_{mode}.rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(STATS, f)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], sys.argv[2:]))
