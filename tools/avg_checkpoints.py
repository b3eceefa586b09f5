"""Average the last N or the best N checkpoints of an OUT_DIR into one checkpoint file.

    python tools/avg_checkpoints.py output/digits --last 3 -o output/digits/avg_last3.pth.tar
    python tools/avg_checkpoints.py output/digits --best 3 --metric top1 -o avg_best3.pth.tar
    python tools/avg_checkpoints.py output/digits --last 3 --weights ema --precise-bn 2000 -o avg.pth.tar

Inputs are OUT_DIR/checkpoints' single files and .dcp folders alike. --best ranks the epoch-end
checkpoints still there by a metric of OUT_DIR/metrics.jsonl (the --split records of the --weights
weights; lower is better for a loss). The raw ("model") or EMA weights are averaged element-wise
and written as the output's raw weights, with the newest input's classes, architecture, config and
preprocessing: test_net.py, predict.py, export.py and MODEL.WEIGHTS take it like any checkpoint.
BatchNorm running statistics are averaged too, an approximation: --precise-bn N recomputes them
for the averaged weights over N training images (BN.PRECISE_IMAGES; trailing KEY VALUE pairs
change the checkpoint's config for it, e.g. TRAIN.DATASET). Runs in one process; exits 2 with one
line on a bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.checkpointing.average import (  # noqa: E402
    averaged_checkpoint,
    best_checkpoints,
    check_output,
    last_checkpoints,
)
from distribuuuu.checkpointing.checkpoint import save_checkpoint  # noqa: E402
from distribuuuu.config import ConfigError  # noqa: E402
from distribuuuu.data import DataError  # noqa: E402
from distribuuuu.errors import CheckpointError, tool_error  # noqa: E402
from distribuuuu.logger import setup_logging  # noqa: E402
from distribuuuu.models import load_model_weights  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv  # noqa: E402
from distribuuuu.training.evaluation import precise_bn  # noqa: E402
from distribuuuu.training.inputs import build_precise_bn_split  # noqa: E402
from distribuuuu.training.parallelize import build_configured_model  # noqa: E402
from distribuuuu.training.stored_config import cfg_from_checkpoint, run_keys  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a training run's OUT_DIR (its checkpoints/ and metrics.jsonl)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, default=0, metavar="N", help="average the newest N checkpoints")
    which.add_argument("--best", type=int, default=0, metavar="N", help="average the best N epoch-end checkpoints")
    parser.add_argument("--metric", default="top1", help="--best's metric, a metrics.jsonl field (default top1)")
    parser.add_argument("--split", default="val", help="--best's records: val or a TEST.EXTRA_DATASETS split")
    parser.add_argument("--lower-is-better", action="store_true", help="--best: lower scores are better (default: "
                        "for a metric named like loss)")  # fmt: skip
    parser.add_argument("--weights", choices=("model", "ema"), default="model", help="average raw or EMA weights")
    parser.add_argument("--precise-bn", type=int, default=0, metavar="N",
                        help="then recompute BatchNorm statistics over N training images (BN.PRECISE_IMAGES)")  # fmt: skip
    parser.add_argument("-o", "--output", required=True, help="the checkpoint file to write (must not exist)")
    parser.add_argument("opts", nargs="*", help="KEY VALUE pairs for --precise-bn's config")
    return parser.parse_intermixed_args(argv)  # KEY VALUE pairs may follow the options


def choose(args: argparse.Namespace) -> tuple[list[str], str]:
    """The input checkpoints, oldest first, and how they were chosen (printed and stored)."""
    if args.last < 0 or args.best < 0 or not (args.last or args.best):
        raise CheckpointError(f"--last/--best must be >= 1, got {args.last or args.best}")
    if args.last:
        return last_checkpoints(args.out_dir, args.last), f"the last {args.last}"
    lower = True if args.lower_is_better else None
    chosen = best_checkpoints(args.out_dir, args.best, args.metric, args.split, args.weights, lower)
    scores = ", ".join(f"{os.path.basename(p)} {v:.4g}" for p, v in chosen)
    return [p for p, _ in chosen], f"the best {args.best} by {args.split} {args.metric} ({scores})"


def recompute_bn(state: dict, images: int, opts: list[str]) -> None:
    """Replace the averaged weights' BatchNorm statistics by precise BN's over ``images`` training images."""
    cfg = cfg_from_checkpoint(
        state, None, [*opts, "BN.PRECISE_IMAGES", str(images), "MODEL.PRETRAINED", "False"], run_keys()
    )
    model = build_configured_model(cfg.MODEL)  # MODEL.PRETRAINED False: the averaged weights replace any download
    load_model_weights(model, state["model"])
    env = DistEnv()
    precise_bn({"averaged": model}, build_precise_bn_split(cfg, env), cfg, env)
    state["model"] = model.state_dict()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(None, 0)
    try:
        if args.precise_bn < 0:
            raise ConfigError(f"--precise-bn must be >= 0, got {args.precise_bn}")
        check_output(args.output)
        paths, how = choose(args)
        print(f"averaging the {args.weights} weights of {how}: {', '.join(os.path.basename(p) for p in paths)}")
        state = averaged_checkpoint(paths, args.weights, how)
        if args.precise_bn:
            recompute_bn(state, args.precise_bn, args.opts)
        save_checkpoint(state, args.output)
    except (CheckpointError, ConfigError, DataError, OSError) as e:
        return tool_error(PROG, e)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
