"""Launch anywhere: ``--nproc N`` (torch.multiprocessing spawn) and ``mpirun``-style environments."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import FAST, TRAIN, assert_ok, clean_env, in_process, python, read_metrics, run

from distribuuuu.checkpointing.checkpoint import load_checkpoint
from distribuuuu.runtime.launcher import find_free_port

ONE_EPOCH = [*FAST, "OPTIM.MAX_EPOCH", "1"]  # later keys win: FAST's 2 epochs become 1
STEPS_2_RANKS = 1436 // (32 * 2)  # train images // (TRAIN.BATCH_SIZE x 2 ranks)


def _assert_trained_on_two_ranks(out_dir: Path) -> None:
    """One epoch ran with a global batch of 64, every val image was evaluated once, and it saved."""
    records = read_metrics(out_dir)
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["epoch"] for r in train] == [1] and [r["epoch"] for r in val] == [1]
    assert train[0]["step"] == STEPS_2_RANKS, "2 ranks share the epoch: half the steps of one process"
    assert train[0]["samples"] == STEPS_2_RANKS * 64
    assert val[0]["samples"] == 361
    state = load_checkpoint(str(out_dir / "checkpoints" / "ckpt_ep_001.pth.tar"))
    assert state["world_size"] == 2 and state["epoch"] == 1 and len(state["rng"]) == 2


def _same_numbers(a: Path, b: Path) -> None:
    """Two runs with the same seeds and rank layout log the same losses and accuracies."""
    fields = [
        (r["split"], k, r[k]) for r in read_metrics(a) if r["split"] in ("train", "val") for k in ("loss", "top1")
    ]
    other = [(r["split"], k, r[k]) for r in read_metrics(b) if r["split"] in ("train", "val") for k in ("loss", "top1")]
    assert [f[:2] for f in fields] == [f[:2] for f in other]
    assert [f[2] for f in fields] == pytest.approx([f[2] for f in other], rel=1e-6), (fields, other)


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``train_net.py --nproc 2``, one epoch: the result and its OUT_DIR."""
    out = tmp_path_factory.mktemp("spawn")
    result = in_process(TRAIN, "--nproc", "2", "OUT_DIR", str(out), *ONE_EPOCH)
    return result, out


@pytest.mark.slow
def test_nproc_2_spawns_two_workers_that_train_and_checkpoint(spawn_run):
    result, out = spawn_run
    assert_ok(result)
    assert "launch, 2 process(es)" in result.stdout
    _assert_trained_on_two_ranks(out)


@pytest.mark.slow
def test_two_processes_with_only_open_mpi_variables_train_like_the_spawned_workers(tmp_path, spawn_run):
    port = str(find_free_port())

    def rank(r: int):
        env = clean_env(
            OMPI_COMM_WORLD_RANK=str(r),
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=str(r),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            MASTER_PORT=port,
        )
        return run(python(TRAIN, "OUT_DIR", str(tmp_path), *ONE_EPOCH), timeout=400, env=env)

    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(rank, (0, 1))
    assert_ok(rank0)
    assert_ok(rank1)
    assert "mpi launch, 2 process(es)" in rank0.stdout
    _assert_trained_on_two_ranks(tmp_path)
    assert_ok(spawn_run[0])
    _same_numbers(tmp_path, spawn_run[1])  # same ranks, seeds and data order, whoever started them


@pytest.mark.parametrize(
    "launcher_env",
    [{"RANK": "0", "WORLD_SIZE": "2"}, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}],
    ids=["torchrun", "mpi"],
)
def test_nproc_under_a_launcher_is_refused(tmp_path, launcher_env):
    result = in_process(TRAIN, "--nproc", "2", "OUT_DIR", str(tmp_path), env=clean_env(**launcher_env))
    assert result.returncode == 2, result.stderr
    assert "--nproc cannot be used under a launcher" in result.stderr
    assert not (tmp_path / "checkpoints").exists(), "nothing was started"


@pytest.mark.parametrize(
    "bad, message",
    [
        (["OPTIM.BASE_LR", "-1"], "OPTIM.BASE_LR must be > 0"),  # caught before any worker starts: in this process
        (["TRAIN.DATASET", "/nonexistent/digits"], "dataset folder not found"),  # caught in both workers
    ],
    ids=["invalid-value", "missing-dataset"],
)
@pytest.mark.slow
def test_spawn_with_a_bad_config_exits_2_and_prints_the_error_once(tmp_path, bad, message):
    argv = (TRAIN, "--nproc", "2", "OUT_DIR", str(tmp_path), *bad)
    result = in_process(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert "Traceback" not in result.stderr


# rank 1 fails at once; rank 0 is still busy when spawn stops it, so it never reaches its error.
FIRST_FAILS = """
import os, sys, time
from distribuuuu import cli
from distribuuuu.config import load_cfg
from distribuuuu.data import DataError
from distribuuuu.runtime.launcher import RankLaunchError

def main(cfg):
    if os.environ["RANK"] == "1":
        raise {error}("rank 1 fails first")
    time.sleep(120)

if __name__ == "__main__":
    sys.exit(cli.spawn(main, 2, load_cfg()))
"""


@pytest.mark.slow  # launches for 10-20 s: out of the quick tier
def test_a_spawned_worker_that_fails_first_has_its_error_printed_once(tmp_path):
    """A DataError (printed by rank 0) and a RankLaunchError (printed by every rank): two jobs, the parent in this process."""

    def job(error: str) -> subprocess.CompletedProcess:
        script = tmp_path / f"first_fails_{error}.py"
        script.write_text(FIRST_FAILS.format(error=error))
        return in_process(str(script))

    for result in map(job, ["DataError", "RankLaunchError"]):
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("distribuuuu: error: rank 1 fails first") == 1, result.stderr


# Both ranks stop for the same Ctrl-C; rank 0 (which writes the checkpoint) ends seconds after rank 1.
BOTH_STOP = """
import os, sys, time
from pathlib import Path
from distribuuuu import cli
from distribuuuu.config import load_cfg
from distribuuuu.runtime.preemption import Interrupted

def main(cfg):
    mark = Path(sys.argv[1])
    if os.environ["RANK"] == "0":
        while not mark.exists():  # rank 1 is about to end
            time.sleep(0.1)
        time.sleep(3)
        mark.write_text("rank 0 ended on its own")
    else:
        mark.write_text("rank 1 ends")
    raise Interrupted("interrupted (Ctrl-C) at epoch 1, step 20, its checkpoint written")

if __name__ == "__main__":
    sys.exit(cli.spawn(main, 2, load_cfg()))
"""


@pytest.mark.slow  # launches two workers: 10-15 s
def test_spawned_workers_stopping_for_a_ctrl_c_end_on_their_own_and_quietly(tmp_path):
    # The first to exit 130 must not have the others terminated (torch's join sends SIGTERM and warns).
    script, mark = tmp_path / "both_stop.py", tmp_path / "rank0"
    script.write_text(BOTH_STOP)
    result = in_process(str(script), str(mark))
    assert result.returncode == 130, result.stderr
    assert mark.read_text() == "rank 0 ended on its own"
    assert result.stderr.strip().splitlines() == [
        "distribuuuu: interrupted (Ctrl-C) at epoch 1, step 20, its checkpoint written; exiting with 130 "
        "(run the same command again to resume there)"
    ], result.stderr
