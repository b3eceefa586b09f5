"""tools/gpu_check.py: one line and exit 2 without a GPU; with --device cpu, the CPU-capable checks
pass under torchrun and the CUDA-only ones skip; a check that raises is a FAIL row and exit 1."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import REPO, assert_ok, in_process, on_ranks, run_torchrun, two_nodes

from benchmarks import gpu_checks
from benchmarks import gpu_harness as harness
from distribuuuu import trainer
from distribuuuu.runtime.launcher import DistEnv, LaunchError, find_free_port
from distribuuuu.runtime.preemption import Interrupted
from distribuuuu.runtime.process_group import (
    all_gather_object,
    all_reduce_sum,
    cleanup_distributed,
    setup_distributed,
)

GPU_CHECK = str(REPO / "tools" / "gpu_check.py")
CPU_CHECKS = {
    "all-reduce + rank table", "fp16 + GradScaler", "bf16 autocast", "channels_last", "fsdp + sharded checkpoint",
    "fsdp fp16 ShardedGradScaler", "resume bit-identical",
}  # fmt: skip


@functools.cache
def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", GPU_CHECK)
    tool = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(tool)
    return tool


def _rows(stdout: str, names: list[str]) -> dict[str, str]:
    """The result column of each check's row in the printed table."""
    rows = {}
    for line in stdout.splitlines():
        name = next((n for n in names if line.startswith(n + " ")), None)
        if name:
            rows[name] = line[len(name) :].split()[0]
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the checks would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    result = in_process(GPU_CHECK)  # a plain single process: the tool's own __main__ in this one
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2, result
    assert len(lines) == 1 and "no CUDA GPU visible" in lines[0], lines


@pytest.mark.slow  # launches, or trains, for 10-20 s: out of the quick tier
def test_several_nodes_without_a_work_dir_are_refused_by_every_rank_in_one_line():
    """Two torchrun agents as two nodes: each worker exits before any collective, rank 0 says why."""
    results = two_nodes(1, GPU_CHECK, [["--device", "cpu"]] * 2, timeout=180)
    output = "".join(r.stdout + r.stderr for r in results)
    assert all(r.returncode != 0 for r in results), output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("gpu_check: error:")]
    assert len(lines) == 1 and "need --work-dir" in lines[0] and "1 on this one" in lines[0], output[-3000:]
    assert not any(line.split()[:2] == ["check", "result"] for line in output.splitlines())  # no table begun


def test_the_work_dir_is_required_exactly_when_ranks_span_several_nodes():
    tool = _tool()
    with pytest.raises(LaunchError, match="4 ranks on several nodes"):
        tool.check_work_dir("", DistEnv(world_size=4, local_world_size=2))
    tool.check_work_dir("/shared/gpu_check", DistEnv(world_size=4, local_world_size=2))
    tool.check_work_dir("", DistEnv(world_size=4, local_world_size=4))  # one node: a temporary folder will do
    tool.check_work_dir("", DistEnv())


def _one_rank(monkeypatch) -> DistEnv:
    """This process as a job of one gloo rank on the CPU, as torchrun --nproc_per_node=1 would set it up."""
    launch = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key, value in {**launch, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(key, value)
    return setup_distributed("gloo")


@pytest.mark.slow
@pytest.mark.usefixtures("plain_logging")
def test_the_resume_check_trains_in_the_tools_process_group_and_leaves_stdout_to_the_table(
    tmp_path, monkeypatch, capsys
):
    """gpu_check's public path into the trainer: train_model(cfg, cleanup=False) with LOG.CONSOLE False."""
    env = _one_rank(monkeypatch)
    try:
        ctx = harness.Context(env, str(tmp_path))
        cfg = harness.make_cfg(
            ctx, "run", "MODEL.ARCH", harness.TINY, "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "128"
        )
        trainer.train_model(cfg, cleanup=False)
        assert dist.is_initialized(), "train_model destroyed the caller's process group"
        assert all_reduce_sum(torch.ones(1)).item() == 1  # and it still serves collectives
    finally:
        cleanup_distributed()
    assert capsys.readouterr().out == ""
    assert "torchrun launch, 1 process(es)" in (tmp_path / "run" / "log.txt").read_text()  # logged, to the file


@pytest.mark.slow
def test_two_gloo_ranks_pass_the_cpu_checks_and_skip_the_cuda_ones(tmp_path):
    result = run_torchrun(2, GPU_CHECK, "--device", "cpu", "--work-dir", str(tmp_path), timeout=300)
    assert_ok(result)
    names = [name for name, _ in gpu_checks.CHECKS]
    rows = _rows(result.stdout, names)
    assert rows == {n: "PASS" if n in CPU_CHECKS else "SKIP" for n in names}, result.stdout
    assert "0:cpu 1:cpu" in result.stdout  # the rank table, one device per rank
    assert "7 passed, 0 failed, 11 skipped" in result.stdout
    # The sync windows trained and augmented on the CPU; only the watching needs CUDA.
    assert "no CUDA: the windows trained on the CPU" in result.stdout


def test_a_check_that_raises_is_a_fail_row_and_the_others_still_run():

    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access\nmore lines")

    def not_here(ctx):
        raise harness.Skip("needs 2 or more ranks")

    def fails(ctx):
        harness.expect(False, "loss did not fall")

    printed: list[str] = []
    checks = [("raises", broken), ("skips", not_here), ("expects", fails), ("passes", lambda ctx: "fine")]
    results = harness.run_checks(checks, ctx=None, print_row=printed.append)
    assert [(r.name, r.status) for r in results] == [
        ("raises", "FAIL"), ("skips", "SKIP"), ("expects", "FAIL"), ("passes", "PASS"),
    ]  # fmt: skip
    assert results[0].detail == "RuntimeError: CUDA error: an illegal memory access"
    assert results[2].detail == "CheckFailed: loss did not fall"
    assert len(printed) == 1 + len(checks) and "FAIL" in printed[1] and "illegal memory access" in printed[1]
    assert harness.exit_code(results) == 1
    assert harness.exit_code(results[1:2] + results[3:]) == 0  # SKIP and PASS only


@pytest.mark.parametrize("stop", ["Ctrl-C in training", "Ctrl-C between steps"])
def test_a_ctrl_c_stops_the_checks_in_one_line_with_exit_130(stop, monkeypatch, capsys):
    """A Ctrl-C the trainer took (it checkpoints and raises Interrupted) was a FAIL row, and the
    remaining checks ran on: the tool did not stop."""
    tool, ran = _tool(), []

    def interrupted(ctx):
        ran.append("interrupted")
        raise (
            Interrupted("interrupted (Ctrl-C) at epoch 1, step 4")
            if stop == "Ctrl-C in training"
            else KeyboardInterrupt
        )

    monkeypatch.setattr(tool, "CHECKS", [("interrupted", interrupted), ("next", lambda ctx: ran.append("next"))])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # main sets it for --device cpu: put back after
    try:
        code = tool.main(["--device", "cpu"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C went past main: Python's traceback")
    assert code == 130 and ran == ["interrupted"]
    assert capsys.readouterr().err.splitlines() == ["gpu_check: stopped (Ctrl-C); exiting with 130"]


def test_a_failure_on_any_rank_fails_the_row_and_names_the_rank():
    ok, bad = harness.Result("x", "PASS", 1.0, "fine"), harness.Result("x", "FAIL", 2.5, "TypeError: boom")
    merged = harness.merge_ranks([ok, bad, ok])
    assert (merged.status, merged.seconds, merged.detail) == ("FAIL", 2.5, "rank 1: TypeError: boom")
    assert harness.merge_ranks([ok, ok]).detail == "fine"


@pytest.mark.usefixtures("plain_logging")
def test_the_fsdp_checkpoint_check_runs_on_a_single_rank_as_on_a_one_gpu_machine(tmp_path, monkeypatch):
    """One GPU is where most users first run the tool: fsdp on one rank trains the plain model and
    writes DCP folders, so that check runs there (it was a SKIP row); the sharded scaler's skips."""
    ctx = harness.Context(_one_rank(monkeypatch), str(tmp_path))
    try:
        rows = {
            name: harness.run_check(name, check, ctx) for name, check in gpu_checks.CHECKS if name.startswith("fsdp")
        }
    finally:
        cleanup_distributed()
    dcp, scaler = rows["fsdp + sharded checkpoint"], rows["fsdp fp16 ShardedGradScaler"]
    assert dcp.status == "PASS" and "plain model (1 rank" in dcp.detail, dcp
    assert scaler.status == "SKIP" and "GradScaler (the fp16 row)" in scaler.detail, scaler


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_ranks_may_share_a_gpu_over_gloo_only(monkeypatch, backend):
    """--backend gloo: two ranks on the one GPU of a machine pass the rank table (NCCL refuses that
    launch; were ranks ever to share a GPU under it, the row fails). Two ranks of a threaded group,
    both reporting the same GPU (the threaded group has no timed wait: the table without it)."""
    monkeypatch.setattr(gpu_checks, "physical_device", lambda env: "GPU-the-one")
    table = {"host": "node0", "device": "cpu"}
    monkeypatch.setattr(
        gpu_checks, "check_group", lambda env, timeout_s: all_gather_object({"rank": env.rank, **table})
    )

    def rank_job(rank: int) -> tuple[str, str]:
        ctx = harness.Context(DistEnv(rank=rank, world_size=2, launcher="torchrun"), "", backend)
        r = harness.run_check("all-reduce + rank table", gpu_checks.check_all_reduce, ctx)
        return r.status, r.detail

    for status, detail in on_ranks(2, rank_job):
        if backend == "gloo":
            assert status == "PASS" and detail.endswith("ranks share a GPU (gloo)"), detail
        else:
            assert status == "FAIL" and "ranks share a device" in detail, detail


@pytest.mark.parametrize("world", [2, 8])
def test_every_ranks_share_of_the_jpeg_digits_holds_jpegs_and_pngs(tmp_path, world):
    """The nvJPEG rows decode each rank's share of the mixed tree (every W-th image): were it all
    PNG, nvJPEG would decode nothing there and the row fail (rank 0 of 2 on one H200, every other
    image a JPEG)."""
    from torchvision.datasets import ImageFolder

    from distribuuuu.data.samplers import ExactEvalSampler

    root = harness.jpeg_tree(str(tmp_path / "tree"), per_class=4 * world + 4)  # as jpeg_dataset sizes it
    files = [path for path, _ in ImageFolder(str(tmp_path / "tree" / "val")).samples]
    assert root == str(tmp_path / "tree")
    for rank in range(world):
        kinds = {os.path.splitext(files[i])[1] for i in ExactEvalSampler(len(files), world, rank)}
        assert kinds == {".jpg", ".png"}, f"rank {rank} of {world} reads only {kinds}"


def test_the_stream_check_reads_which_thread_launched_each_kernel_and_on_which_stream():
    # A chrome trace as torch.profiler writes it: kernels carry their stream and the correlation
    # id of the runtime call that launched them, which carries the launching thread.
    def launch(tid, correlation):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "args": {"correlation": correlation}}

    def kernel(name, stream, correlation):
        return {"cat": "kernel", "name": name, "args": {"stream": stream, "correlation": correlation}}

    events = [launch(11, 1), kernel("gemm", 21, 1), launch(11, 2), kernel("elementwise", 21, 2)]
    events += [launch(12, 3), kernel("ncclDevKernel_AllReduce_Sum_f32", 13, 3), launch(12, 4), kernel("reduce", 7, 4)]
    assert harness.kernel_streams(events, thread=11) == ({21}, {13})
    events += [launch(11, 5), kernel("gemm", 13, 5)]  # the prepare thread on NCCL's stream
    mine, nccl = harness.kernel_streams(events, thread=11)
    assert mine & nccl == {13}
