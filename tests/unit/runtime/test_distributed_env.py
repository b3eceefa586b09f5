"""Launcher detection (torchrun, Slurm, MPI, none) from an environment mapping, and rank helpers."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import gloo_threads
from torch import nn

from distribuuuu.runtime import process_group as D
from distribuuuu.runtime.launcher import (
    DEFAULT_PORT,
    SPAWN_ERROR_VAR,
    LaunchError,
    detect_env,
    find_free_port,
    parse_slurm_nodelist,
)


def _slurm(**extra: str) -> dict[str, str]:
    """What srun sets for task 5 of 8, 4 per node, on a compressed node list."""
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODELIST": "gpu[01-04,07],cpu3",
        "SLURM_JOB_ID": "123456",
        "SLURM_TASKS_PER_NODE": "4(x2)",
    }
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------
# Slurm node lists
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("host", ["host"]),
        ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ],
)
def test_parse_slurm_nodelist_expands_compressed_lists(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


# ------------------------------------------------------------------------------------------------
# detect_env
# ------------------------------------------------------------------------------------------------
def test_nothing_set_is_a_single_plain_process():
    env = detect_env({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert env.launcher == "none" and not env.distributed and env.is_main_process


def test_torchrun_variables():
    env = detect_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29600",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.7", 29600, "torchrun")
    assert env.distributed and not env.is_main_process


def test_slurm_variables_map_to_rank_local_rank_and_first_host():
    env = detect_env(_slurm(MASTER_PORT="23456"))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu01", 23456, "slurm")


def test_slurm_tasks_per_node_gives_the_local_world_size():
    assert detect_env(_slurm(SLURM_TASKS_PER_NODE="8(x2)")).local_world_size == 8
    assert detect_env(_slurm(SLURM_TASKS_PER_NODE="2")).local_world_size == 2


def test_slurm_port_is_derived_from_the_job_id_when_master_port_is_unset():
    port_a = detect_env(_slurm(SLURM_JOB_ID="1001")).master_port
    port_b = detect_env(_slurm(SLURM_JOB_ID="1002")).master_port
    assert port_a != port_b, "two jobs sharing a node must not rendezvous on one port"
    assert detect_env(_slurm(SLURM_JOB_ID="1001", SLURM_PROCID="0")).master_port == port_a, "same on every rank"
    assert all(1024 < p < 65536 for p in (port_a, port_b))


def test_slurm_master_addr_from_the_environment_wins_over_the_node_list():
    assert detect_env(_slurm(MASTER_ADDR="10.1.2.3")).master_addr == "10.1.2.3"


def test_torchrun_inside_a_slurm_allocation_wins():
    env = detect_env(_slurm(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501"))
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("torchrun", 0, 2, "127.0.0.1")


def test_workers_of_nproc_say_spawn_though_they_hold_torchruns_variables():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}
    spawned = detect_env({**torchrun, SPAWN_ERROR_VAR: "/tmp/errors/1.json"})  # what cli.spawn sets in each
    assert (spawned.launcher, spawned.rank, spawned.world_size) == ("spawn", 1, 2) and spawned.distributed
    assert detect_env(torchrun).launcher == "torchrun"


@pytest.mark.parametrize(
    "names",
    [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ],
    ids=["open-mpi", "mpich-intel"],
)
def test_mpi_variables_map_like_slurms(names):
    rank, size, local_rank, local_size = names
    env = detect_env({rank: "5", size: "8", local_rank: "1", local_size: "4", "MASTER_ADDR": "gpu01"})
    slurm = detect_env(_slurm(MASTER_PORT=str(DEFAULT_PORT)))
    assert env.launcher == "mpi"
    for field in ("rank", "world_size", "local_rank", "local_world_size", "master_addr", "master_port"):
        assert getattr(env, field) == getattr(slurm, field), field


def test_mpi_on_one_node_needs_no_master_addr():
    env = detect_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "127.0.0.1")


@pytest.mark.parametrize(
    "environ",
    [
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"},
    ],
    ids=["open-mpi", "mpich-intel"],
)
def test_mpi_across_nodes_without_master_addr_is_a_launch_error(environ):
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        detect_env(environ)


def test_mpi_wins_over_the_batch_steps_slurm_variables():
    env = detect_env({**_slurm(SLURM_PROCID="0"), "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (env.launcher, env.rank) == ("mpi", 3)


# ------------------------------------------------------------------------------------------------
# Rank helpers without and with a process group
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def test_rank_helpers_work_without_a_process_group(no_launcher):
    assert D.get_rank() == 0 and D.get_world_size() == 1 and D.is_main_process()
    D.barrier()
    t = torch.tensor([1.5, 2.0])
    assert D.all_reduce_sum(t) is t and t.tolist() == [1.5, 2.0]
    tensors = [torch.tensor([3.0]), torch.tensor([4.0])]
    assert D.scaled_all_reduce(tensors) is tensors and [x.item() for x in tensors] == [3.0, 4.0]
    assert D.all_gather_object({"a": 1}) == [{"a": 1}]
    assert D.broadcast_object("x") == "x"


def test_setup_distributed_with_a_one_rank_gloo_group_then_cleanup(no_launcher, monkeypatch):
    # setup_distributed writes MASTER_ADDR/PORT into os.environ; monkeypatch restores them after.
    monkeypatch.setenv("MASTER_ADDR", "unused")
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # keep pytest's thread count
    port = find_free_port()
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        env = D.setup_distributed(backend="", timeout_s=60, environ=environ)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert env.device == torch.device("cpu") and env.launcher == "torchrun"
        assert D.is_dist() and D.get_rank() == 0 and D.get_world_size() == 1
        assert D.all_reduce_sum(torch.tensor([2.0])).item() == 2.0
        assert D.all_gather_object(7) == [7]
        assert D.check_group(env, timeout_s=30)[0]["rank"] == 0
    finally:
        D.cleanup_distributed()
    assert not dist.is_initialized()
    D.cleanup_distributed()  # a second call is harmless


# ------------------------------------------------------------------------------------------------
# Ending the process group: nothing may keep it alive past cleanup_distributed
# ------------------------------------------------------------------------------------------------
# A group still referenced after destroy_process_group ends during interpreter shutdown, where a
# gloo worker thread that releases its last work (~AsyncWork -> ~ThreadLocalState -> a Python
# object's decref -> take_gil) is stopped by pthread_exit inside a destructor: std::terminate,
# "terminate called without an active exception", exit -6 (a core dump of such a rank showed this
# stack). So every test below checks that the group's gloo threads have ended.
@pytest.fixture
def one_rank_group(no_launcher, monkeypatch) -> Iterator[tuple[weakref.ref, set[int]]]:
    """A one-rank gloo group set up as a launched tool's: a reference to it that does not keep it
    alive, and the gloo threads of this process before it. Cleaned up after, whatever the test did."""
    monkeypatch.setenv("MASTER_ADDR", "unused")  # setup_distributed writes them; monkeypatch restores them
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # keep pytest's thread count
    before = gloo_threads()
    environ = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    D.setup_distributed(backend="gloo", timeout_s=60, environ=environ)
    try:
        yield weakref.ref(dist.group.WORLD), before
    finally:
        D.cleanup_distributed()


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """The collector runs only when called: garbage stays until cleanup_distributed collects it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _assert_ended(group: weakref.ref, threads_before: set[int]) -> None:
    assert group() is None, "something still references the destroyed process group"
    assert gloo_threads() <= threads_before, "the group's gloo threads still run"


def test_cleanup_ends_a_group_that_dtensors_caches_still_hold(one_rank_group):
    """DTensor caches every device mesh it redistributes over (torch 2.14: the redistribute
    planners) for the process's life, and a mesh holds its groups: after an FSDP job, the group
    outlived the tool (tools/benchmark.py --what memory, 2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group, threads = one_rank_group
    sharded = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert sharded.full_tensor().tolist() == [0.0, 1.0, 2.0, 3.0]
    del sharded  # the job's own references are gone: only torch's caches are left
    D.cleanup_distributed()
    _assert_ended(group, threads)


@pytest.mark.usefixtures("no_automatic_gc")
def test_cleanup_ends_a_group_that_garbage_in_a_reference_cycle_holds(one_rank_group):
    """A DDP model in a reference cycle (FSDP's modules and their hooks make thousands of objects of
    them) holds the group until the collector runs: at interpreter shutdown, if nothing else runs it."""
    group, threads = one_rank_group
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    model.cycle = [model]
    del model
    D.cleanup_distributed()
    _assert_ended(group, threads)


def test_the_exit_hook_ends_a_group_that_a_printed_traceback_holds(one_rank_group, monkeypatch):
    """An error raised past a tool's entry point: Python prints it and keeps it (sys.last_traceback),
    with the frames that hold the model, until the interpreter finalizes. The hook atexit runs (before
    finalizing) lets go of it. A fresh interpreter's exit: test_an_error_no_tool_catches_..., slow."""
    group, threads = one_rank_group

    def job() -> None:
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        model(torch.randn(3, 4)).sum().backward()
        raise RuntimeError("a bug after the model was built")

    try:
        job()
    except RuntimeError as e:  # what Python keeps of an error it printed (monkeypatch puts back pytest's)
        monkeypatch.setattr(sys, "last_type", type(e), raising=False)
        monkeypatch.setattr(sys, "last_value", e, raising=False)
        monkeypatch.setattr(sys, "last_traceback", e.__traceback__, raising=False)
    D.cleanup_distributed()  # run_main's, as the error went past it
    assert group() is not None, "the traceback's frames hold the model, and it the group"
    D._end_before_exit()
    _assert_ended(group, threads)
    assert sys.last_traceback is None
