"""Measure training, evaluation and data-pipeline speed; compare the trainer with a hand-written DDP loop.

Runs under the same launchers as training and reads the same config::

    python tools/benchmark.py [--steps 30 --repeats 5 --what train,plain] [--cfg FILE] [KEY VALUE ...]
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 tools/benchmark.py MODEL.ARCH resnet18 TRAIN.BATCH_SIZE 64
    srun python tools/benchmark.py --cfg FILE

Rank 0 prints one JSON object per line per measurement (also appended to ``--json PATH``) and a
table at the end. Training (``train``) is what a user's run does: epochs of the configured dataset
through the trainer's public ``train_one_epoch`` (its DataLoader, sync points and epoch boundary),
alternating with a minimal hand-written DDP loop (``plain``: same model, initial weights, batch,
optimizer and parameter groups, dataset and transforms, DataLoader workers, world size) so drift
hits both alike. The other measurements run on MODEL.DUMMY_INPUT data (in memory).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks.suite import DEFAULT_WHAT, WHAT, benchmark, memory_table  # noqa: E402
from distribuuuu.cli import parse_args  # noqa: E402
from distribuuuu.config import ConfigError  # noqa: E402
from distribuuuu.data import DataError  # noqa: E402
from distribuuuu.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, first_line, tool_error  # noqa: E402
from distribuuuu.runtime.launcher import LaunchError, RankLaunchError, detect_env_rank  # noqa: E402

PROG = os.path.basename(__file__)  # what argparse calls this tool in its errors
_LAUNCHER_FLAGS = ("--local_rank", "--local-rank")  # torch.distributed.launch's, passed to cli.parse_args


def parse_bench_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """Split the benchmark's own flags from the training tools' ``--cfg FILE KEY VALUE ...``."""
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=0,
        help="train/plain: the last N steps of each timed epoch (0: whole epochs, as a run trains);\n"
        "the synthetic measurements: steps per repetition (0: 30)",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before measuring each implementation")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (median and spread reported)")
    p.add_argument("--what", default=DEFAULT_WHAT, help=f"comma-separated subset of {','.join(WHAT)}")
    p.add_argument("--workers", type=counts(0), default="0,1,2", help="DataLoader worker counts for --what data")
    p.add_argument(
        "--data-batches", type=int, default=20,
        help="batches timed per data-pipeline measurement, after the workers' queue (whole rounds of the workers)",
    )  # fmt: skip
    p.add_argument("--photos", type=int, default=96, help="synthetic JPEGs generated for --what decode / packed")
    p.add_argument("--bf16-steps", type=int, default=3, help="timed steps of the bf16 variants (slow on CPUs)")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    p.add_argument("--index-folder", default="", help="--what index: this split folder (default: make ImageNet's)")
    p.add_argument("--index-entries", type=int, default=1_281_167, help="--what index: files of the folder it makes")
    p.add_argument(
        "--index-ranks", type=counts(1), default="2,4", help="--what index: local rank counts whose start-up is timed"
    )
    p.add_argument(
        "--memory-table", type=counts(1), default="", metavar="WORLD_SIZES",
        help="driver: for each world size (e.g. 1,2,4), model (--archs) and strategy (ddp, ddp+ZeRO-1, fsdp)\n"
        "start one torchrun job of --what memory, then print the per-rank bytes table with img/s vs ddp",
    )  # fmt: skip
    p.add_argument(
        "--archs", default="resnet18", help="--memory-table: comma-separated MODEL.ARCH[:KWARG=VALUE...] values"
    )
    p.add_argument("--cfg", dest="cfg_file", default=None, help="YAML config file, as train_net.py's")
    p.usage = p.format_usage().removeprefix("usage: ").rstrip() + " [KEY VALUE ...]"
    bench, rest = p.parse_known_args(argv)
    # What is left is the config's KEY VALUE pairs: any other flag is refused here, with this
    # usage (cli.parse_args' would name flags of the training tools, --nproc, that this one lacks).
    unknown = [a for a in rest if a.startswith("--") and a.split("=", 1)[0] not in _LAUNCHER_FLAGS]
    if unknown:
        hint = "; start several processes with torchrun --nproc_per_node=N" if "--nproc" in unknown else ""
        p.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    what = [w for w in bench.what.split(",") if w]
    unknown = [w for w in what if w not in WHAT]
    if unknown or min(bench.repeats, bench.data_batches, bench.bf16_steps) < 1 or min(bench.warmup, bench.steps) < 0:
        p.error(f"--what must name items of {WHAT} (got {unknown}); --repeats, ... must be >= 1, --steps >= 0")
    bench.what = what
    return bench, parse_args([*(["--cfg", bench.cfg_file] if bench.cfg_file else []), *rest], __doc__)


def counts(minimum: int) -> Callable[[str], list[int]]:
    """argparse's type for a comma-separated list of whole numbers >= ``minimum`` ("0,1,2")."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = [minimum - 1]
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= {minimum}, got {text!r}")
        return values

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    bench, cfg_args = parse_bench_args(argv)
    if bench.memory_table:
        return drive_memory_table(bench, cfg_args)
    try:
        benchmark(bench, cfg_args)
    except (ConfigError, DataError, LaunchError) as e:
        # The same error on every rank (a rank's own launch error aside): printed once.
        if isinstance(e, RankLaunchError) or detect_env_rank() == 0:
            tool_error(PROG, first_line(e))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches every rank: one line, as train_net.py's
        if detect_env_rank() == 0:
            print(f"{PROG}: interrupted (Ctrl-C); exiting with {EXIT_INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def drive_memory_table(bench: argparse.Namespace, cfg_args: argparse.Namespace) -> int:
    """--memory-table: print the table; a failed job or a Ctrl-C is one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        print(memory_table(bench, cfg_args))
    except ChildFailedError as e:  # the failing rank's own error is on stderr above
        rank, failure = min(e.failures.items())
        tool_error(PROG, f"a --what memory job failed: rank {rank} exited {failure.exitcode}")
        return EXIT_FAILED
    except (KeyboardInterrupt, SignalException) as e:  # torchrun's agent, in this process, raises the latter
        signum = getattr(e, "sigval", signal.SIGINT)
        print(f"{PROG}: interrupted ({signal.Signals(signum).name}); no table", file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
