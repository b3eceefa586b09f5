"""The process group: set-up for torchrun, Slurm, MPI or a plain process, collectives and rank helpers.

Which launcher started us is read by ``launcher.py`` (pure). Every helper here works with or
without a process group, so unit tests and notebooks can call them.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from distribuuuu.errors import first_line
from distribuuuu.runtime.heartbeat import Heartbeat
from distribuuuu.runtime.launcher import (
    DistEnv,
    LaunchError,
    RankLaunchError,
    detect_env,
    detect_env_rank,
    select_device,
)

T = TypeVar("T")
# The store every rank met at (set by setup_distributed): it keeps answering while a worker is
# stalled, so a failed collective can ask it which peers are missing.
_STORE: dist.Store | None = None
# This rank's heartbeat thread (see heartbeat.py), stopped by cleanup_distributed.
_HEARTBEAT: Heartbeat | None = None


def setup_distributed(
    backend: str = "",
    timeout_s: float = 1800,
    environ: Mapping[str, str] | None = None,
    join_timeout_s: float = 60,
    stall_s: float = 0,
) -> DistEnv:
    """Detect the launcher, pick the device and initialise the process group (if launched).

    NCCL on the process's GPU when CUDA is available, else gloo on the CPU; ``backend`` overrides
    the choice. A plain ``python`` run gets no process group at all. Every rank must reach the
    rendezvous within ``join_timeout_s`` (DIST.INIT_CHECK_TIMEOUT_S), so a rank that never starts
    fails the job quickly, naming itself; collectives then get ``timeout_s``. With ``stall_s`` > 0
    (DIST.STALL_S), a heartbeat thread names the ranks that stop answering for that long.
    """
    env = detect_env(environ)
    try:
        device = select_device(env.local_rank, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    except LaunchError as e:
        raise RankLaunchError(f"rank {env.rank}: {e}") from None
    if device.type == "cuda":  # GPU seam: bind this process to its GPU
        torch.cuda.set_device(device)
    else:
        _set_cpu_threads(env.local_world_size)
    env = DistEnv(**{**env.__dict__, "device": device})
    if not env.distributed or dist.is_initialized():
        return env
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise LaunchError("DIST.BACKEND nccl needs CUDA, which is not available: use gloo")
    global _STORE, _HEARTBEAT
    store = _STORE = join_rendezvous(env, join_timeout_s)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    if stall_s > 0 and env.world_size > 1:
        _HEARTBEAT = Heartbeat(store, env.rank, env.world_size, stall_s, timeout_s).start()
    return env


def join_rendezvous(env: DistEnv, timeout_s: float) -> dist.Store:
    """Meet every rank at MASTER_ADDR:MASTER_PORT within ``timeout_s``, or raise a RankLaunchError naming who is missing.

    ``init_process_group`` alone would wait the long collective timeout for a rank that never
    started. The rendezvous store is opened with the short timeout instead (rank 0 waits there
    for every rank to connect), then each rank checks in under its own key, which also catches a
    missing rank where torchrun's agent hosts the store and nobody waits at connect time.
    """
    where = f"{env.master_addr}:{env.master_port}"
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.master_addr, str(env.master_port)
    try:
        store, _, _ = next(
            dist.rendezvous("env://", env.rank, env.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        )
    except dist.DistError as e:
        who = "not every rank reached" if env.rank == 0 else "could not reach rank 0's"
        raise RankLaunchError(
            f"rank {env.rank}: {who} rendezvous at {where} within {timeout_s:g}s (DIST.INIT_CHECK_TIMEOUT_S): "
            f"{first_line(e)}; check that every rank started and that MASTER_ADDR/MASTER_PORT agree"
        ) from None
    missing = _check_in(store, env, timeout_s)
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        raise RankLaunchError(
            f"rank {env.rank}: rank(s) {shown} of {env.world_size} did not join the rendezvous at {where} "
            f"within {timeout_s:g}s (DIST.INIT_CHECK_TIMEOUT_S)"
        )
    return store


def _check_in(store: dist.Store, env: DistEnv, timeout_s: float) -> list[int]:
    """Write this rank's key, wait for everyone's; return the ranks missing at the deadline."""
    # torchrun's agent keeps its store across restarts: keys are per attempt.
    prefix = f"distribuuuu/joined/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/{env.rank}", "1")
    count = store.add(f"{prefix}/count", 1)
    deadline = time.monotonic() + timeout_s
    while count < env.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.add(f"{prefix}/count", 0)
    if count >= env.world_size:
        return []
    return [r for r in range(env.world_size) if not store.check([f"{prefix}/{r}"])]


def _set_cpu_threads(local_world_size: int) -> None:
    # Several processes on one CPU must share its cores: oversubscribing 2 cores with 2 x 2
    # threads measured 3x slower than 2 x 1. Respect an explicit OMP_NUM_THREADS (torchrun's).
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))


def rendezvous_store() -> dist.Store | None:
    """The store setup_distributed met the other ranks at (None if it started no process group)."""
    return _STORE if is_dist() else None


def cleanup_distributed() -> None:
    """Stop the heartbeat and destroy the process group, if there are."""
    global _STORE, _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None


def is_dist() -> bool:
    """True when a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank (0 without a process group, or from the launcher's env before init)."""
    return dist.get_rank() if is_dist() else detect_env_rank()


def get_world_size() -> int:
    """Number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if is_dist() else 1


def get_local_rank() -> int:
    """Rank of this process on its node."""
    try:
        return detect_env().local_rank
    except (LaunchError, ValueError):
        return 0


def is_main_process() -> bool:
    """True on global rank 0 (and in a plain single process)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if is_dist():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks, in place, and return it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def scaled_all_reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Average tensors over ranks in place (Distribuuuu's helper): sum, then divide by world size.

    A mean of per-rank means is only exact when every rank saw the same number of samples; for
    metrics prefer summing counts with all_reduce_sum.
    """
    if not is_dist():
        return tensors
    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    world = dist.get_world_size()
    for t in tensors:
        t.mul_(1.0 / world)
    return tensors


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank, in place."""
    if is_dist():
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every rank of ``group`` (a one-element list without a process group)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Return global rank ``src``'s object on every rank of ``group``."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def rank0_decides(decide: Callable[[], T]) -> T:
    """Run ``decide`` on global rank 0 alone; every rank returns its result or raises its error.

    The one way to do "rank 0 looks (at the disk, at OUT_DIR), everyone learns it": an exception
    on rank 0 is raised on every rank (same type and message), so all ranks stop together and
    the error is printed once.
    """
    result: Any = None
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            result = decide()
        except Exception as e:  # re-raised below, on every rank
            error = e
    result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def check_group(env: DistEnv, timeout_s: float) -> list[dict]:
    """Check every rank answers within ``timeout_s`` and return the rank -> host -> device table.

    One tiny all-reduce with a short timeout fails fast on a wrong address or a missing rank,
    instead of the first gradient all-reduce hanging for the long training timeout.
    """
    me = {
        "rank": env.rank,
        "host": socket.gethostname(),
        "local_rank": env.local_rank,
        "device": str(env.device),
    }
    if not is_dist():
        return [me]
    probe = torch.ones(1, device=env.device)
    work = dist.all_reduce(probe, async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise RankLaunchError(
            f"rank {env.rank}: start-up check of the process group failed within {timeout_s:g}s "
            f"(DIST.INIT_CHECK_TIMEOUT_S): {first_line(e)}"
        ) from None
    if int(probe.item()) != env.world_size:
        raise RankLaunchError(f"rank {env.rank}: start-up all-reduce gave {probe.item()}, expected {env.world_size}")
    return all_gather_object(me)


def format_rank_table(rows: list[dict]) -> str:
    """Render the rank -> host -> local rank -> device table."""
    lines = [f"{'rank':>5}  {'host':<24} {'local':>5}  device"]
    lines += [f"{r['rank']:>5}  {r['host']:<24} {r['local_rank']:>5}  {r['device']}" for r in rows]
    return "\n".join(lines)
