"""The levers for more than one GPU, on 2 gloo ranks in one job (tests/scripts/levers_job.py):
TRAIN.COMPILE compiles the DDP-wrapped model, whose backward then runs in pieces with the buckets'
all-reduces between them; gradient accumulation under it still all-reduces once a step; bf16 steps
with fused SGD; DIST.COMM_HOOK bf16 all-reduces 16-bit gradients. Each against the plain run's numbers."""

from __future__ import annotations

import json

import pytest
from helpers import DDP_FSDP_REL, REPO, assert_ok, clean_env, run_torchrun

JOB = str(REPO / "tests" / "scripts" / "levers_job.py")


@pytest.fixture(scope="module")
def levers(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("levers") / "levers.json"
    assert_ok(run_torchrun(2, JOB, str(out), timeout=300, env=clean_env()))
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compiled_ddp_all_reduces_buckets_while_its_backward_still_runs(levers):
    compiled = levers["compiled"]
    order = compiled["order"]  # the last step: each compiled backward piece, each bucket's all-reduce
    assert order.count("piece") >= 2 and order.count("bucket") >= 2, order
    # a bucket's all-reduce starts before the backward's last piece has run: they can overlap
    assert order.index("bucket") < len(order) - 1 - order[::-1].index("piece"), order
    # Eager and compiled kernels sum in another order: a few float32 ulps a step (DDP_FSDP_REL's reasoning).
    assert compiled["relative"] <= DDP_FSDP_REL, compiled
    # The order before (DDP around the compiled module) trains the same numbers.
    assert levers["compiled_before_wrap"]["relative"] <= DDP_FSDP_REL, levers["compiled_before_wrap"]


@pytest.mark.slow
def test_accumulation_under_compile_all_reduces_once_per_optimizer_step(levers):
    # no_sync reaches DDP through the compiled module: 2 micro-batches, the buckets of 1.
    assert levers["compiled_accum"]["buckets"] == levers["compiled"]["buckets"] == levers["eager"]["buckets"]
    assert levers["compiled_accum"]["relative"] <= DDP_FSDP_REL, levers["compiled_accum"]


@pytest.mark.slow
def test_bf16_steps_with_fused_sgd_and_trains_the_foreach_loops_weights(levers):
    assert levers["bf16_fused"]["fused"] and not levers["bf16_foreach"]["fused"] and not levers["eager"]["fused"]
    # The same update in one kernel: equal up to float32 rounding, which bf16's forward can carry
    # to a bf16 step (2^-8) once a weight crosses a rounding boundary. Bound, as for FSDP against
    # DDP: how far bf16 alone moves the run from float32's, twice (each lies that far from it).
    # Seen here: 0 (bit for bit), against a bound of 4e-3.
    assert levers["bf16_fused"]["largest"] <= 2 * levers["bf16_foreach"]["largest"], levers["bf16_fused"]
    assert levers["bf16_foreach"]["largest"] > 1e-5  # bf16 autocast did run


@pytest.mark.slow
def test_the_bf16_comm_hook_moves_the_weights_by_bf16_rounding_of_the_gradients(levers):
    # DIST.COMM_HOOK bf16: each rank's gradient / 2 rounded to bf16 (2^-8 of it), the two summed
    # and rounded in bf16 (2^-8 of the sum): the averaged gradient off by at most 2^-7 of the
    # largest local gradient G_j of step j. SGD with Nesterov momentum m moves a weight by
    # lr * (1 + m) * m^(k - j) of step j's gradient at step k, so after the steps the weights
    # differ by at most 2^-7 lr sum_k sum_(j<=k) (1 + m) m^(k-j) G_j; twice that, for the second-order
    # change of the gradients themselves (the two runs' weights differ after the first step).
    hook, eager = levers["bf16_comm_hook"], levers["eager"]
    lr, m, grad_max = eager["lr"], eager["momentum"], eager["grad_max"]
    steps = len(grad_max)
    reach = sum((1 + m) * m ** (k - j) * grad_max[j] for k in range(steps) for j in range(k + 1))
    bound = 2 * 2**-7 * lr * reach
    assert 0 < hook["largest"] <= bound, (hook["largest"], bound)  # 0: the hook did not run
