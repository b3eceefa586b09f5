"""OPTIM.OPTIMIZER muon under FSDP2 on 2 ranks (a launch of tests/scripts/muon_fsdp_job.py) steps as on the
replicated model. The launch of tests/unit/training/test_muon.py."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, assert_ok, clean_env, run_torchrun


@pytest.mark.slow
def test_muon_under_fsdp_on_2_ranks_steps_as_on_the_replicated_model(tmp_path):
    """FSDP2's Muon steps on DTensor shards: the Newton-Schulz iteration redistributes them (DTensor's own
    collectives inside the step), so it orthogonalises the whole matrix, not each rank's rows.

    Fed the same full-rank gradients three steps running, the sharded and the replicated weights differ
    by the order of the bf16 sums alone (torch iterates Newton-Schulz in bf16): up to 4 ulps (2**-8) of
    the update's largest entry (at most 1.2, the band's top) a step, times Muon's adjusted LR (1.8 ulps
    measured). AdamW's update is elementwise: the same on shards, bit for bit. Orthogonalising each
    rank's rows alone moves a weight by a third of the adjusted LR in the first step alone (measured):
    the last assertion shows the bound tells that apart.
    """
    out = tmp_path / "muon_fsdp.json"
    job = str(REPO / "tests" / "scripts" / "muon_fsdp_job.py")
    assert_ok(run_torchrun(2, job, str(out), timeout=240, env=clean_env()))
    result = json.loads(out.read_text())
    bound = 3 * 4 * 2**-8 * 1.2 * 0.01 * 0.2 * result["max_dim"] ** 0.5
    assert result["muon_matrices"] == 8 and result["sharded"]  # TinyViT: 2 layers x (in, out, 2 MLP) projections
    assert result["weights"] <= bound, (result, bound)
    assert result["adamw_weights"] == 0.0, result
    assert result["per_shard_weights"] > 3 * bound, (result, bound)
