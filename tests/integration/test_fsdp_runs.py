"""FSDP and HSDP launched on 2 and 4 ranks against DDP's weights, and compile with channels_last under FSDP: the
launches of tests/unit/runtime/test_fsdp.py."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from helpers import REPO, assert_ok, clean_env, run_torchrun

from distribuuuu.checkpointing.checkpoint import load_checkpoint

JOB = str(REPO / "tests" / "scripts" / "fsdp_job.py")


def _job(tmp_path, nproc: int, strategy: str) -> dict:
    out = tmp_path / f"{strategy}.json"
    assert_ok(run_torchrun(nproc, JOB, str(out), strategy, timeout=240, env=clean_env()))
    return json.loads(out.read_text())


def _check_against_ddp(results: dict) -> None:
    """FSDP's run trains DDP's weights: exactly in fp32, within 16-bit rounding's own reach in bf16.

    fp32: reduce-scatter and all-reduce sum in another order, nothing else differs (1e-6; 6e-8 seen).
    bf16: the two runs' fp32 weights differ by that summation order at the first clipped step, and
    a weight that moves across a bf16 rounding boundary is rounded one bf16 step (2**-8 relative)
    apart from then on: how far that carries after a few steps depends on the CPU's kernels, not on
    FSDP (1.5e-8 on one AMD EPYC, 1.1e-3 on another). So the bound is measured in the same job:
    how far bf16 alone moves DDP's run from the same run in fp32 (``weights_vs_fp32``). Each bf16
    run lies about that far from the fp32 run, so two of them lie within twice that of each other.
    Planted bugs this still catches (measured, bf16 ResNet / ViT, bound 4.5e-3 / 1.2e-3):
    clipping by each rank's local norm 5.7e-3 / 8.9e-3, a reduce-scatter skipped every other step
    8.0e-3 / 1.6e-2, one shard from the wrong rank 0.33 / 0.34; the fp32 scenarios catch each of
    them by orders of magnitude.
    """
    for name, r in results.items():
        if name == "world_size":
            continue
        if "weights_vs_fp32" in r:
            tol = 2 * r["weights_vs_fp32"]
            assert tol > 1e-5, f"{name}: bf16 moved DDP's run by {tol / 2}: did autocast run at all?"
            # FSDP's run rounds in 16 bits too: as far from fp32 as DDP's, not 1e-7 (autocast off).
            assert r["fsdp_vs_fp32"] > tol / 20, (name, r["fsdp_vs_fp32"], tol)
            norm_rel = 2 * max(abs(a - b) / b for a, b in zip(r["norms_ddp"], r["norms_fp32"]))
        else:
            tol, norm_rel = 1e-6, 1e-6
        assert r["weights"] <= tol and r["ema"] <= tol, (name, tol, r)
        assert r["norms_fsdp"] == pytest.approx(r["norms_ddp"], rel=norm_rel), (name, norm_rel)
        assert all(n > 0.5 for n in r["norms_ddp"]), "clipping at 0.5 must be active"
        assert r["param_dtype"] == "torch.float32"  # the sharded master weights stay fp32
        # Parameters, gradients and momentum each take half the bytes on a rank: sharded over 2.
        for kind, ddp_bytes in r["bytes_ddp"].items():
            assert r["bytes_fsdp"][kind] == pytest.approx(ddp_bytes / 2, rel=0.02), (name, kind)


@pytest.mark.slow
def test_fsdp_on_2_ranks_trains_the_weights_of_ddp_with_accumulation_clipping_and_ema(tmp_path):
    results = _job(tmp_path, 2, "fsdp")
    assert results.keys() >= {"plain", "accum_clip", "bf16_accum_clip", "vit_bf16_params"}
    _check_against_ddp(results)


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_trains_the_weights_of_ddp(tmp_path):
    results = _job(tmp_path, 4, "hsdp")
    assert results["world_size"] == 4 and results.keys() >= {"accum_clip", "bf16_accum_clip"}
    _check_against_ddp(results)


@pytest.fixture(scope="module")
def compiled_fsdp_run(tmp_path_factory):
    """The run of the test below: (its OUT_DIR, the process)."""
    tmp_path = tmp_path_factory.mktemp("compiled_fsdp")
    opts = ["TRAIN.SPLIT", "val", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "1"]
    opts += ["DIST.STRATEGY", "fsdp", "TRAIN.COMPILE", "True", "TRAIN.CHANNELS_LAST", "True"]
    # One eval batch per rank: under fsdp the blocks compile with static shapes, so each batch size
    # compiles every block again (77 s -> 61 s here, cold Inductor cache).
    opts += ["TEST.BATCH_SIZE", "256"]
    return tmp_path, run_torchrun(2, str(REPO / "tools" / "train_net.py"), "OUT_DIR", str(tmp_path), *opts, timeout=600)


@pytest.mark.slow
def test_compile_and_channels_last_under_fsdp_train_a_checkpoint_the_plain_model_loads(compiled_fsdp_run):
    tmp_path, result = compiled_fsdp_run
    assert_ok(result)
    assert "TRAIN.COMPILE under fsdp: 8 block(s) compiled" in result.stdout  # resnet18's BasicBlocks
    assert "channels_last inputs, contiguous weights" in result.stdout + result.stderr
    state = load_checkpoint(str(tmp_path / "checkpoints" / "ckpt_ep_001.dcp"))
    plain = torchvision.models.resnet18(num_classes=10)
    plain.load_state_dict(state["model"])  # the names of the plain model: no compile or FSDP prefix
    assert all(torch.isfinite(p).all() for p in plain.parameters())
