"""Which launcher started this process (torchrun, --nproc's spawn, MPI, Slurm or none) and where it sits: pure.

Reading the environment needs no process group; ``process_group.py`` builds on this, never the reverse.
Importing this module does not import torch (``startup.py`` imports it before torch has loaded);
making a DistEnv does, for its device.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_PORT = 29500
# Set in each worker by ``--nproc`` (cli.spawn), beside torchrun's variables: the file that hands
# the worker's error line to its parent.
SPAWN_ERROR_VAR = "DISTRIBUUUU_SPAWN_ERROR_FILE"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "none"  # torchrun | spawn (--nproc) | mpi | slurm | none
    device: torch.device = field(default_factory=lambda: _device("cpu"))

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.launcher != "none"


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent."""


class RankLaunchError(LaunchError):
    """A launch failure that some ranks see and others may not (a missing peer, a GPU count):
    every rank that sees it reports it, naming itself, since rank 0 may be the one missing."""


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list, e.g. ``gpu[01-02,07],cpu3`` -> gpu01 gpu02 gpu07 cpu3.

    Parsed here rather than with ``scontrol show hostnames`` so it works inside containers and on
    login-less compute nodes where scontrol is absent.
    """
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        # Split "rack[1-2]-n[01-02]" into literal text and bracket groups; expand their product.
        parts = re.split(r"\[([^\]]*)\]", item)
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _expand_range(spec: str) -> list[str]:
    out: list[str] = []
    for piece in spec.split(","):
        lo, _, hi = piece.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo)  # keep zero padding: 01-10 -> 01 02 ... 10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _tasks_on_first_node(tasks_per_node: str) -> int:
    """Parse SLURM_TASKS_PER_NODE ("8(x2),4") to the task count of this job's first node."""
    match = re.match(r"(\d+)", tasks_per_node or "")
    return int(match.group(1)) if match else 1


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address from the environment (no side effects).

    Precedence: torchrun / torch.distributed.launch variables, then MPI (Open MPI, MPICH, Intel
    MPI), then Slurm, then a plain single process. torchrun wins inside a Slurm allocation, and
    MPI wins over Slurm because an ``mpirun`` inside ``sbatch`` inherits the batch step's
    SLURM_PROCID=0 in every rank.
    """
    env = os.environ if environ is None else environ
    return _torchrun_env(env) or _mpi_env(env) or _slurm_env(env) or DistEnv()


def _torchrun_env(env: Mapping[str, str]) -> DistEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return DistEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
        launcher="spawn" if SPAWN_ERROR_VAR in env else "torchrun",  # --nproc sets torchrun's variables too
    )


def _mpi_env(env: Mapping[str, str]) -> DistEnv | None:
    for rank_key, size_key, local_key, local_size_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if rank_key not in env or size_key not in env:
            continue
        world = int(env[size_key])
        local_world = int(env.get(local_size_key, world))
        if local_world < world and "MASTER_ADDR" not in env:
            raise LaunchError(
                f"MPI launch across nodes ({world} ranks, {local_world} on this node) needs "
                "MASTER_ADDR set to the first node's address (e.g. mpirun -x MASTER_ADDR=host1)"
            )
        return DistEnv(
            rank=int(env[rank_key]),
            world_size=world,
            local_rank=int(env.get(local_key, 0)),
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            launcher="mpi",
        )
    return None


def _slurm_env(env: Mapping[str, str]) -> DistEnv | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    get = env.get
    nodelist = get("SLURM_STEP_NODELIST") or get("SLURM_NODELIST") or get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("Slurm launch: SLURM_NODELIST is not set")
    job_id = int(get("SLURM_JOB_ID", 0))
    # Two jobs sharing a node must not pick the same port: derive it from the job id.
    port = int(get("MASTER_PORT", 15000 + job_id % 20000))
    return DistEnv(
        rank=int(env["SLURM_PROCID"]),
        # Inside a step (srun) the step's own variables win over the job's: `srun -n 4` in an
        # allocation of 8 tasks runs 4 ranks.
        world_size=int(get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
        local_rank=int(get("SLURM_LOCALID", 0)),
        local_world_size=_tasks_on_first_node(get("SLURM_STEP_TASKS_PER_NODE") or get("SLURM_TASKS_PER_NODE", "1")),
        master_addr=get("MASTER_ADDR") or parse_slurm_nodelist(nodelist)[0],
        master_port=port,
        launcher="slurm",
    )


def detect_env_rank() -> int:
    """Global rank read from the environment alone (for error printing before set-up)."""
    try:
        return detect_env().rank
    except (LaunchError, ValueError):
        return 0


def _device(kind: str, index: int | None = None) -> torch.device:
    import torch

    return torch.device(kind, index)


def select_device(local_rank: int, visible_gpus: int) -> torch.device:
    """The device of a process, from its LOCAL_RANK and the number of GPUs it sees (pure).

    No GPU: the CPU. Exactly one visible GPU: that one, whatever LOCAL_RANK is, because clusters
    that bind one GPU per task (``srun --gpus-per-task=1``, ``--gpu-bind=single:1``, a prolog
    setting CUDA_VISIBLE_DEVICES per task) show each task only its own while SLURM_LOCALID runs
    0..7. Several visible GPUs: the one at LOCAL_RANK.
    """
    if visible_gpus == 0:
        return _device("cpu")
    if visible_gpus == 1:
        return _device("cuda", 0)
    if local_rank < visible_gpus:
        return _device("cuda", local_rank)
    raise LaunchError(
        f"LOCAL_RANK {local_rank} but only {visible_gpus} GPUs visible on {socket.gethostname()}: "
        "start at most one process per GPU, or show each process one GPU"
    )


def find_free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
