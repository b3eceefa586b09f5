"""Real multi-process jobs on the CPU (gloo): srun-style launch, exact evaluation, auto-resume, utils."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import FAST, REPO, TEST, TRAIN, assert_ok, clean_env, python, read_metrics, run, torchrun

from distribuuuu.checkpoint import load_checkpoint
from distribuuuu.launch import find_free_port

ONE_EPOCH = [*FAST, "OPTIM.MAX_EPOCH", "1"]  # later keys win: FAST's 2 epochs become 1
THREE_EPOCHS = [*FAST, "OPTIM.MAX_EPOCH", "3"]
IM_SIZE_16 = ["TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]  # evaluate at the size it was trained at
# Counted on disk, not copied from a run: 361, divisible by neither 2 nor 3.
VAL_IMAGES = sum(1 for p in (REPO / "data" / "digits" / "val").rglob("*") if p.is_file())
UTILS_JOB = str(REPO / "tests" / "scripts" / "utils_job.py")


def _split(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r["split"] == split]


def _run_together(cmd: list[str], envs: list[dict], log_dir: Path, timeout: float) -> list[tuple[int, str, str]]:
    """Start one process per env (each in its own session), wait for all; kill all on timeout."""
    procs, logs = [], []
    for i, env in enumerate(envs):
        out, err = log_dir / f"task{i}.out", log_dir / f"task{i}.err"
        logs.append((out, err))
        with open(out, "w") as fo, open(err, "w") as fe:  # files, not pipes: no task blocks on a full pipe
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe, start_new_session=True))
    timer = threading.Timer(timeout, lambda: [_kill(p) for p in procs])
    timer.start()
    try:
        codes = [p.wait() for p in procs]
    finally:
        timer.cancel()
        for p in procs:
            _kill(p)
    results = [(code, out.read_text(), err.read_text()) for code, (out, err) in zip(codes, logs)]
    assert all(code != -signal.SIGKILL for code in codes), f"killed after {timeout}s: {results}"
    return results


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ------------------------------------------------------------------------------------------------
# srun-style launch: SLURM_* variables only, no torchrun
# ------------------------------------------------------------------------------------------------
def test_two_tasks_with_only_slurm_variables_train_and_checkpoint(tmp_path):
    out_dir = tmp_path / "out"
    port, job_id = str(find_free_port()), "4242"
    envs = [
        clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_ID=job_id,
            SLURM_TASKS_PER_NODE="2",
            MASTER_PORT=port,
        )
        for rank in (0, 1)
    ]
    results = _run_together(python(TRAIN, "OUT_DIR", str(out_dir), *ONE_EPOCH), envs, tmp_path, timeout=400)
    for code, out, err in results:
        assert code == 0, f"exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "slurm launch, 2 process(es)" in (out_dir / "log.txt").read_text()
    records = read_metrics(out_dir)
    [train], [val] = _split(records, "train"), _split(records, "val")
    assert train["step"] == 1436 // (32 * 2), "two ranks share the epoch: a global batch of 2 x 32"
    assert val["samples"] == VAL_IMAGES == 361
    assert (out_dir / "checkpoints" / "ckpt_ep_001.pth.tar").is_file()
    assert (out_dir / "best.pth.tar").is_file()
    assert load_checkpoint(str(out_dir / "checkpoints" / "ckpt_ep_001.pth.tar"))["world_size"] == 2
    # The val numbers the 2-rank run reported are those of the weights it saved: one process
    # evaluating the checkpoint finds them again (BatchNorm statistics included, hence the loss).
    weights = str(out_dir / "checkpoints" / "ckpt_ep_001.pth.tar")
    assert_ok(run(python(TEST, "OUT_DIR", str(tmp_path / "test"), *ONE_EPOCH, "MODEL.WEIGHTS", weights), timeout=300))
    [test] = _split(read_metrics(tmp_path / "test"), "test")
    assert (test["top1"], test["topk"], test["samples"]) == (val["top1"], val["topk"], val["samples"])
    assert test["loss"] == pytest.approx(val["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# Auto-resume: stop after epoch 1, run again, end exactly where an uninterrupted run ends
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> dict:
    """Run A: 3 epochs in one go. Run B: the same, stopped after epoch 1, then started again."""
    run_a, run_b = tmp_path_factory.mktemp("run_a"), tmp_path_factory.mktemp("run_b")
    uninterrupted: dict = {}
    # Run A alongside run B's two invocations: each process is single-threaded and seeded.
    thread = threading.Thread(
        target=lambda: uninterrupted.update(r=run(python(TRAIN, "OUT_DIR", str(run_a), *THREE_EPOCHS), timeout=400))
    )
    thread.start()
    try:
        first = run(python(TRAIN, "OUT_DIR", str(run_b), *THREE_EPOCHS, "TRAIN.STOP_AFTER_EPOCHS", "1"), timeout=400)
        assert_ok(first)
        first_epochs = [r["epoch"] for r in _split(read_metrics(run_b), "train")]
        second = run(python(TRAIN, "OUT_DIR", str(run_b), *THREE_EPOCHS), timeout=400)
        assert_ok(second)
    finally:
        thread.join()
    assert_ok(uninterrupted["r"])
    return {"a": run_a, "b": run_b, "first_epochs": first_epochs, "second": second}


def test_auto_resume_continues_exactly_like_an_uninterrupted_run(resume_runs):
    run_a, run_b, second = resume_runs["a"], resume_runs["b"], resume_runs["second"]
    assert resume_runs["first_epochs"] == [1], "TRAIN.STOP_AFTER_EPOCHS 1 stopped after epoch 1"
    assert "resumed from" in second.stdout and "ckpt_ep_001.pth.tar" in second.stdout
    assert "epoch 1/3" not in second.stdout, "the second invocation must not train epoch 1 again"
    train_a, train_b = _split(read_metrics(run_a), "train"), _split(read_metrics(run_b), "train")
    assert [r["epoch"] for r in train_b] == [1, 2, 3]
    assert [r["step"] for r in train_b] == [r["step"] for r in train_a]
    assert [r["lr"] for r in train_b] == pytest.approx([r["lr"] for r in train_a], rel=1e-12)

    final_a = load_checkpoint(str(run_a / "checkpoints" / "ckpt_ep_003.pth.tar"))
    final_b = load_checkpoint(str(run_b / "checkpoints" / "ckpt_ep_003.pth.tar"))
    assert final_a["epoch"] == final_b["epoch"] == 3
    assert final_a["model"].keys() == final_b["model"].keys()
    differing = [k for k, v in final_a["model"].items() if not torch.equal(v, final_b["model"][k])]
    assert not differing, f"resumed weights differ from the uninterrupted run's: {differing[:5]}"


# ------------------------------------------------------------------------------------------------
# Exact evaluation: the same numbers for any world size
# ------------------------------------------------------------------------------------------------
def test_test_net_gives_identical_results_for_world_size_1_2_3(resume_runs, tmp_path):
    # Run A is a one-process training run: evaluate its last checkpoint (trained, ~95% top-1, so
    # an image lost or counted twice would show in the counts, and always in the loss sum).
    trained = resume_runs["a"]
    weights = str(trained / "checkpoints" / "ckpt_ep_003.pth.tar")

    def evaluate(world: int) -> dict:
        out_dir = tmp_path / f"ws{world}"
        args = ("OUT_DIR", str(out_dir), "MODEL.WEIGHTS", weights, *IM_SIZE_16)
        assert_ok(run(python(TEST, *args) if world == 1 else torchrun(world, TEST, *args), timeout=400))
        [record] = _split(read_metrics(out_dir), "test")
        return record

    with ThreadPoolExecutor(3) as pool:  # mostly start-up time: overlap the three jobs
        results = dict(zip((1, 2, 3), pool.map(evaluate, (1, 2, 3))))
    for world in (2, 3):
        for key in ("top1", "topk", "samples"):
            assert results[world][key] == results[1][key], (key, world, results)
        assert results[world]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
    assert results[1]["samples"] == VAL_IMAGES, "every val image counted once, none padded or dropped"
    assert results[1]["top1"] > 50, "the checkpoint should be trained, far above the 10% of chance"
    # The training run's own evaluation of these weights after epoch 3 agrees as well.
    val = next(r for r in read_metrics(trained) if r["split"] == "val" and r["epoch"] == 3)
    assert (val["top1"], val["topk"], val["samples"]) == (results[1]["top1"], results[1]["topk"], VAL_IMAGES)


def test_test_net_without_weights_exits_2_naming_model_weights(tmp_path):
    result = run(python(TEST, "OUT_DIR", str(tmp_path)), timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distribuuuu: error:") and "MODEL.WEIGHTS" in lines[0], lines


# ------------------------------------------------------------------------------------------------
# distribuuuu.utils in a user's own script
# ------------------------------------------------------------------------------------------------
def test_utils_job_runs_under_torchrun_with_two_processes(tmp_path):
    result = run(torchrun(2, UTILS_JOB, str(tmp_path)), timeout=300)
    assert_ok(result)
    ok_lines = sorted(line.split()[1] for line in result.stdout.splitlines() if line.startswith("OK rank="))
    assert ok_lines == ["rank=0", "rank=1"], result.stdout
    assert "world=2" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth.tar"], "one file, written once, no temp left"
    state = load_checkpoint(str(tmp_path / "model.pth.tar"))
    assert state["saved_by"] == 0
