"""The training loop talks to other ranks and syncs the host only at its PRINT_FREQ sync points, and
that one all-reduce carries every rank's step time and data wait (per-rank slots: a sum is a gather).

Every public collective of ``torch.distributed`` and every host-sync method of ``torch.Tensor``
(``item``, ``tolist``, ``__bool__``, ...) is wrapped to record the step at which it was called,
then ``trainer.train_epoch`` trains 25 steps on the embedded digits with PRINT_FREQ 10. DDP's own
gradient all-reduce runs inside its C++ reducer and is not counted. The recording and the checks are
tests/hot_loop_helpers.py's. (The two-process job, tests/scripts/hot_loop_job.py's:
tests/integration/test_hot_loop_runs.py.)
"""

from __future__ import annotations

import pytest
from hot_loop_helpers import (
    STEPS,
    _digits_run,
    check_collectives,
    check_gathered,
    check_host_syncs,
    gathered_times,
    one_rank_group,
    record_epoch,
    with_batches,
)

from distribuuuu import trainer
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.process_group import all_reduce_sum


@pytest.fixture(scope="module")
def digits_batches() -> list:
    """The 25 training batches of one epoch, decoded once for the module.

    The data pipeline runs on the host by design (its augmentations call ``.item()`` on CPU
    tensors); decoding beforehand leaves only the loop's own calls in the recorded epoch.
    """
    return list(_digits_run(DistEnv()).train.loader)


# fp16: GradScaler's overflow checks and skipped-step count must stay on the device too.
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_rank_loop_syncs_only_every_print_freq_steps(digits_batches, precision):
    with one_rank_group(), gathered_times() as seen:
        run = with_batches(_digits_run(DistEnv(), precision), digits_batches)
        assert run.steps_per_epoch == STEPS
        calls = record_epoch(run)
    check_collectives(calls)
    check_host_syncs(calls)
    check_gathered(seen, 1)


def test_the_checks_catch_a_per_step_all_reduce_and_item(digits_batches, monkeypatch):
    """What the original Distribuuuu did every step, an all-reduce and an ``.item()``, must fail both checks."""
    train_step = trainer.train_step

    def chatty_train_step(run, micro_batches, sums):
        loss = train_step(run, micro_batches, sums)
        all_reduce_sum(loss.detach().clone()).item()
        return loss

    monkeypatch.setattr(trainer, "train_step", chatty_train_step)
    with one_rank_group():
        calls = record_epoch(with_batches(_digits_run(DistEnv()), digits_batches), start=STEPS - 6)
    for check, message in ((check_collectives, "collectives outside"), (check_host_syncs, "host syncs at steps")):
        with pytest.raises(AssertionError, match=message):
            check(calls, first_step=STEPS - 6)
    assert sorted({step for _, name, step in calls if name == "item"}) == list(range(STEPS - 6, STEPS))
