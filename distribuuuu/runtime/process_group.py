"""The process group: set-up for torchrun, Slurm, MPI or a plain process, collectives and rank helpers.

Which launcher started us is read by ``launcher.py`` (pure). Every helper here works with or
without a process group, so unit tests and notebooks can call them.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import sys
import time
import types
import weakref
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
# The groups cleanup_distributed destroyed that something still held when it returned: a later
# call (run_main's, after the tool's frames are gone) and the exit hook let go of them.
_DESTROYED: list[weakref.ref] = []
_EXIT_HOOK = False  # whether _end_before_exit is registered


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
    _register_exit_hook()
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
    """Stop the heartbeat, destroy the process group and let go of it, if there are.

    ``destroy_process_group`` does not end a group: its gloo threads end with its last reference.
    A group still referenced ends during interpreter shutdown instead, where a gloo thread that
    needs the GIL is stopped mid-destructor and aborts the process now and then ("terminate called
    without an active exception", exit -6 after a job that succeeded). So this also drops what
    keeps a destroyed group alive (``_let_go``). Call it where the tool's models are gone: a model
    still referenced by the caller holds the group until a later call or the exit hook.
    """
    global _STORE, _HEARTBEAT, _DESTROYED
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None
    if dist.is_available() and dist.is_initialized():
        _DESTROYED += [weakref.ref(group) for group in _every_group()]
        dist.destroy_process_group()
    _STORE = None
    _DESTROYED = _let_go(_DESTROYED)


def _every_group() -> list[dist.ProcessGroup]:
    """The default group and every group made from it (a device mesh's dimensions, for HSDP)."""
    from torch.distributed import distributed_c10d

    return [*distributed_c10d._world.pg_names] or [dist.group.WORLD]


def _let_go(destroyed: list[weakref.ref]) -> list[weakref.ref]:
    """End the destroyed groups that something still holds; return the ones still held after.

    What held them after a tool's job (tools/benchmark.py --what memory, torch 2.14):
    - DTensor's caches (redistribute planners, sharding propagation) keep the device meshes they
      saw for the process's life, and a mesh holds its groups (``DeviceMesh._pg_registry``);
    - a module of torch first imported while a group exists keeps that group as a default argument
      (``group=dist.group.WORLD`` is evaluated at import: ZeroRedundancyOptimizer's ``_broadcast_object``);
    - reference cycles (FSDP's modules and hooks, a traceback's frames) until the collector runs.
    """
    destroyed = [ref for ref in destroyed if ref() is not None]
    if destroyed:
        _drop_captured_defaults([ref() for ref in destroyed])
        gc.collect()
    destroyed = [ref for ref in destroyed if ref() is not None]
    if destroyed:  # held beyond the cycles: by a cache
        _detach_meshes([ref() for ref in destroyed])
    return [ref for ref in destroyed if ref() is not None]


def _drop_captured_defaults(groups: list[dist.ProcessGroup]) -> None:
    """Turn a default argument of torch.distributed's functions that is one of ``groups`` into None
    (the default group, which is what the function would have had if imported before any group)."""
    held = {id(group) for group in groups}
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for value in list(vars(module).values()):
            methods = issubclass(type(value), type)  # a class: its functions
            for function in list(vars(value).values()) if methods else [value]:
                if type(function) is not types.FunctionType:
                    continue
                if any(id(d) in held for d in function.__defaults__ or ()):
                    function.__defaults__ = tuple(None if id(d) in held else d for d in function.__defaults__)
                for key, d in (function.__kwdefaults__ or {}).items():
                    if id(d) in held:
                        function.__kwdefaults__[key] = None


def _detach_meshes(groups: list[dist.ProcessGroup]) -> None:
    """Remove ``groups`` from every device mesh still alive (whoever caches the mesh): destroyed,
    they are of no use to it."""
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_type is None:  # no mesh was ever made
        return
    for obj in gc.get_objects():
        registry = getattr(obj, "_pg_registry", None) if issubclass(type(obj), mesh_type) else None
        if isinstance(registry, dict):
            for name in [n for n, group in registry.items() if any(group is g for g in groups)]:
                del registry[name]


def _register_exit_hook() -> None:
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        atexit.register(_end_before_exit)
        _EXIT_HOOK = True


def _end_before_exit() -> None:
    """The last way out: end the process group while the interpreter is still whole.

    atexit runs before the interpreter starts finalizing, when a gloo thread can still take the
    GIL. It covers the exits no cleanup_distributed call sees to: an error raised past the tool's
    entry point (its traceback, kept as ``sys.last_traceback``, holds the frames that hold the
    models) and a script that never called cleanup_distributed.
    """
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    cleanup_distributed()


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


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Take the elementwise maximum of a tensor over ranks, in place, and return it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
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
