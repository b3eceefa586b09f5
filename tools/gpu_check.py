"""GPU acceptance check: run what the CPU-only test suite cannot, and print a pass/fail table.

    torchrun --nproc_per_node=8 tools/gpu_check.py     # every check, SyncBatchNorm across 8 GPUs
    torchrun --nproc_per_node=1 tools/gpu_check.py     # or: python tools/gpu_check.py
    torchrun --nproc_per_node=2 tools/gpu_check.py --device cpu   # developers: gloo on the CPU
    torchrun --nproc_per_node=2 tools/gpu_check.py --backend gloo # two ranks sharing one GPU (gloo)

It takes well under 5 minutes on one node: each check trains a few steps or two short epochs on
the embedded data/digits at 16x16 pixels. Rank 0 prints one row per check (name, PASS / FAIL /
SKIP, seconds, one line of detail) as it finishes; a check fails when it fails on any rank, and a
failing check does not stop the others. Exit status: 0 if no check failed, 1 if one did, 2 if
there is nothing to check (no CUDA GPU visible: one line says so) or the launch is wrong.

``--device cpu`` runs the checks that make sense without CUDA (all-reduce and rank table with
gloo, fp16 and bf16 autocast, channels_last, fsdp with DCP checkpoints and ShardedGradScaler,
resume) and skips the CUDA-only ones with a reason; the sync-debug checks still train and augment
before skipping, so their code runs. The test suite runs it that way. Trainer runs write to a
temporary folder, removed at the end; ``--work-dir DIR`` keeps them, and ranks on several nodes
need it, on a filesystem every node shares (without it the tool refuses in one line). A check that
fails on some ranks only, inside a collective, may hold the others until the 300 s timeout.

``--backend gloo`` runs the CUDA checks over gloo, which (unlike NCCL) lets several ranks share one
GPU: on a machine with one GPU that is the only way to run the checks that need two ranks
(SyncBatchNorm's statistics, fsdp's shards). A collective gloo refuses on CUDA tensors is that
check's FAIL row, with gloo's message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_checks import CHECKS  # noqa: E402
from benchmarks.gpu_harness import Context, exit_code, run_checks  # noqa: E402
from distribuuuu.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, first_line  # noqa: E402
from distribuuuu.runtime.launcher import DistEnv, LaunchError, detect_env, detect_env_rank  # noqa: E402
from distribuuuu.runtime.preemption import Preempted  # noqa: E402
from distribuuuu.runtime.process_group import (  # noqa: E402
    barrier,
    broadcast_object,
    cleanup_distributed,
    setup_distributed,
)

EXIT_NOTHING_TO_CHECK = EXIT_BAD_INPUT  # no CUDA GPU visible, or a wrong launch


def describe(env: DistEnv, backend: str) -> str:
    where = f"{env.world_size} rank(s) on {env.device.type}" + (f" ({backend})" if backend else "")
    where += f", torch {torch.__version__}"
    if env.device.type == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple on current PyTorch, an int on old ones
        where += f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"
        where += f", {torch.cuda.get_device_name(env.device)}"
    return where


def check_work_dir(work_dir: str, launch: DistEnv) -> None:
    """Refuse several nodes without --work-dir: rank 0's temporary folder is not on the other nodes.

    Their ranks would not find the resume check's checkpoint and leave the collectives, the others
    waiting on them until the timeout. Every rank decides alike from its launcher's variables,
    before any collective, so all of them exit.
    """
    if launch.world_size > launch.local_world_size and not work_dir:
        raise LaunchError(
            f"{launch.world_size} ranks on several nodes ({launch.local_world_size} on this one) need "
            "--work-dir DIR on a filesystem every node shares (the default temporary folder is rank 0's alone)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, CUDA checks skip")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: ranks may share a GPU (with --device cuda)"
    )
    parser.add_argument("--work-dir", default="", help="keep the trainer runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is first touched: the trainer's device is the CPU
    elif not torch.cuda.is_available():
        if detect_env_rank() == 0:
            print(
                "gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check", file=sys.stderr
            )
        return EXIT_NOTHING_TO_CHECK
    try:
        check_work_dir(args.work_dir, detect_env())
        env = setup_distributed("gloo" if args.device == "cpu" else args.backend, timeout_s=300)
    except (LaunchError, ValueError) as e:
        if detect_env_rank() == 0:
            print(f"gpu_check: error: {first_line(e)}", file=sys.stderr)
        return EXIT_NOTHING_TO_CHECK
    work_dir = broadcast_object(
        args.work_dir or (tempfile.mkdtemp(prefix="gpu_check_") if env.is_main_process else None)
    )
    say = (lambda line: print(line, flush=True)) if env.is_main_process else (lambda line: None)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else ""
    say(f"gpu_check: {describe(env, backend)}")
    try:
        results = run_checks(CHECKS, Context(env, work_dir, backend), say)
        failed, skipped = (sum(r.status == s for r in results) for s in ("FAIL", "SKIP"))
        say(f"gpu_check: {len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped")
        barrier()  # every rank is done with the work folder before rank 0 removes it
        return exit_code(results)
    except (KeyboardInterrupt, Preempted) as e:  # every rank stops; no barrier: they stopped in different places
        code = getattr(e, "exit_code", EXIT_INTERRUPTED)
        if env.is_main_process:
            why = "Ctrl-C" if code == EXIT_INTERRUPTED else first_line(e)
            print(f"gpu_check: stopped ({why}); exiting with {code}", file=sys.stderr, flush=True)
        return code
    finally:
        if env.is_main_process and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
