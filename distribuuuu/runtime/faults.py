"""What goes wrong while training: failed or timed-out collectives (named), and non-finite losses."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from distribuuuu.errors import first_line
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import is_dist, rendezvous_store


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names epoch and step."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the step."""


# How long a rank whose collective failed waits for the other ranks to report the same failure.
PEER_REPORT_S = 5.0
_FAILED_KEY = "distribuuuu/collective_failed"
# torch.distributed raises DistError (and subclasses) for most failures, but gloo still raises a
# plain RuntimeError when a collective times out (torch 2.14: "Timed out waiting 3000ms for recv
# operation"), so a plain RuntimeError is also matched on what gloo, NCCL and the store say.
_COMM_FAILURE = re.compile(
    r"timed? ?out|timeout|closed by peer|connection|pair closure|broken pipe|nccl|gloo|store", re.IGNORECASE
)


def is_comm_failure(e: BaseException) -> bool:
    """True for the errors of a failed or timed-out collective (not, say, a shape error)."""
    return isinstance(e, dist.DistError) or (type(e) is RuntimeError and bool(_COMM_FAILURE.search(str(e))))


def silent_ranks(rank: int, world_size: int, wait_s: float = PEER_REPORT_S) -> list[int] | None:
    """After a failed collective, the ranks that do not report a failure too: the stalled or dead ones.

    gloo and NCCL name an address at best, never the rank that stopped answering. Every rank whose
    collective fails writes a key to the process group's store, which keeps answering while a
    worker is stopped (it lives in torchrun's agent, or in rank 0); ranks that have written none
    after ``wait_s`` are stuck elsewhere or gone. None when the store cannot tell (no process
    group, a group not started by setup_distributed, or a store that does not answer, e.g.
    because rank 0 hosts it and is the one stuck).
    """
    store = rendezvous_store()
    if store is None or not is_dist() or world_size < 2:
        return None
    result: list[list[int]] = []
    # torchrun's static rendezvous keeps one store across restarts: keys are per attempt.
    prefix = f"{_FAILED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def report_and_poll() -> None:
        store.set(f"{prefix}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                result.append(missing)
                return
            time.sleep(0.2)

    # A thread, because a store op on a store that does not answer blocks for the long timeout.
    thread = threading.Thread(target=_quietly, args=(report_and_poll,), daemon=True)
    thread.start()
    try:
        thread.join(wait_s + 2.0)
    except Exception:  # a signal handler raised meanwhile (DataLoader's SIGCHLD): keep the first error
        return None
    return result[0] if result else None


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # the store is gone too: silent_ranks returns None
        pass


def collective_error(e: BaseException, rank: int, world_size: int, what: str, timeout_s: float) -> CollectiveError:
    """A one-line CollectiveError naming this rank, what failed (with epoch and step) and the silent peers."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))  # drop gloo's "[/path/to/pair.cc:561]" prefix
    if not is_comm_failure(e):
        return CollectiveError(f"rank {rank}: {what} failed: {first}")
    silent = silent_ranks(rank, world_size)
    if silent:
        peers = f"rank(s) {silent} did not report the failure within {PEER_REPORT_S:g}s: stalled or dead"
    elif silent == []:
        peers = "every rank saw it fail"
    else:
        peers = "could not tell which rank stalled"
    return CollectiveError(f"rank {rank}: {what} failed (DIST.TIMEOUT_S={timeout_s:g}): {peers}; backend: {first}")


@contextlib.contextmanager
def naming_failed_collectives(env: DistEnv, timeout_s: float, where: Callable[[], object]):
    """Turn a raw backend error from a collective outside the training step (validation,
    checkpoint, resume) into a CollectiveError naming the rank, the step and the stalled peers.

    Our own errors already carry their context and pass through unchanged. ``where`` returns the
    run's TrainState at the time of the failure.
    """
    try:
        yield
    except RuntimeError as e:
        if not is_dist() or not is_comm_failure(e):
            raise
        state = where()
        what = f"collective outside a training step, at epoch {state.epoch + 1}, step {state.step_in_epoch}"
        raise collective_error(e, env.rank, env.world_size, what, timeout_s) from e


def check_finite(totals: dict, window_losses: list, epoch: int, step: int, policy: str) -> None:
    """Raise NonFiniteLossError naming the first bad step if the window had one and the policy is stop."""
    if totals["nonfinite"] and policy == "stop":
        raise NonFiniteLossError(
            f"non-finite loss at epoch {epoch + 1}, step {first_nonfinite_step(window_losses, step)}: "
            "lower OPTIM.BASE_LR, enable TRAIN.CLIP_GRAD_NORM, or set TRAIN.NAN_POLICY skip"
        )


def first_nonfinite_step(window_losses: list, last_step: int) -> int:
    """The first step of the window whose loss was non-finite (the earliest over ranks)."""
    losses = torch.stack(window_losses)
    bad = (~torch.isfinite(losses)).nonzero()
    local = last_step - len(window_losses) + 1 + int(bad[0]) if len(bad) else last_step + 1
    if is_dist():
        box = torch.tensor([local], dtype=torch.int64, device=losses.device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        local = int(box.item())
    return local
