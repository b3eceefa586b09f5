"""train_net.py with the suite's models (tests/models.py) and fault injection, driven by environment variables.

The real entry point (``cli.run_tool(trainer.train_model)``) runs unchanged; only the model and
the hooks below are added, so a test can inject a fault at an exact, computable step:

- ``FAULT_NAN_CALLS``, ``FAULT_INF_GRAD_CALLS``: tests/models.py's ``tiny_cnn`` returns NaN logits or an
  infinite gradient at those forward calls.
- ``FAULT_FP16_INIT_SCALE=16777216``: the GradScaler starts at this scale (never grows within the run).
- ``FAULT_SIGNAL_AT_STEP=N`` (with ``FAULT_SIGNAL=SIGTERM|SIGUSR1``, ``FAULT_SIGNAL_RANK=0``, or ``all``):
  after global optimizer step N (1-based) the process sends itself the signal, as a scheduler would
  (``FAULT_SIGNAL_DELAY_S``: after that many seconds more, its other threads running meanwhile).
- ``FAULT_SLOW_DATA=RANK:SECONDS``: that rank waits SECONDS more for each batch, as a rank on a node with a
  slow disk does (the others then wait for it in every gradient all-reduce: a straggler).
- ``FAULT_RECORD=DIR``: each rank appends, per optimizer step, the sampler keys it trained on, the
  LR and the global sample position before the step to ``DIR/steps_w<W>_r<rank>.jsonl``; after a
  resume, rank 0 saves the whole resumed state (model, optimizer by index, EMA, progress) to
  ``DIR/resumed_w<W>.pt``, gathered for the test's comparison (a sharded run never does that itself).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

import models  # noqa: E402, F401  (registers the suite's models)

from distribuuuu import cli, trainer  # noqa: E402
from distribuuuu.config import load_cfg  # noqa: E402


def _signal_hook() -> None:
    """Wrap trainer.train_step so that this rank signals itself after a given global step."""
    at, ranks = int(os.environ.get("FAULT_SIGNAL_AT_STEP", "0")), os.environ.get("FAULT_SIGNAL_RANK", "0")
    if not at or ranks != "all" and int(os.environ.get("RANK", "0")) != int(ranks):
        return
    sig = getattr(signal, os.environ.get("FAULT_SIGNAL", "SIGTERM"))
    real_step = trainer.train_step

    def train_step(run, micro_batches, sums):
        loss = real_step(run, micro_batches, sums)
        if run.global_step + 1 == at:  # global_step still counts the steps before this one
            time.sleep(float(os.environ.get("FAULT_SIGNAL_DELAY_S", "0")))
            os.kill(os.getpid(), sig)
        return loss

    trainer.train_step = train_step


def _scaler_hook() -> None:
    """Wrap trainer.build_run so that the fp16 GradScaler starts at FAULT_FP16_INIT_SCALE."""
    init_scale = float(os.environ.get("FAULT_FP16_INIT_SCALE", "0"))
    if not init_scale:
        return
    real_build_run = trainer.build_run

    def build_run(cfg, env):
        run = real_build_run(cfg, env)
        run.scaler = torch.amp.GradScaler(env.device.type, init_scale=init_scale, growth_interval=10**6)
        return run

    trainer.build_run = build_run


def _stalled_checkpoint_hook() -> None:
    """FAULT_STALL_CHECKPOINT: the write of the checkpoint of that name stops half-way, forever (until
    killed), after writing FAULT_STALL_MARKER with the name of the thread that writes it."""
    name, marker = os.environ.get("FAULT_STALL_CHECKPOINT"), os.environ.get("FAULT_STALL_MARKER")
    if not name:
        return
    import threading

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if f"{name}." in os.path.basename(getattr(f, "name", "")):  # the temporary beside it: .<name>.<random>.part
            f.write(b"\0" * 4096)  # a partial file on disk, as a write cut short leaves
            f.flush()
            with open(marker, "w") as m:
                m.write(threading.current_thread().name)
            threading.Event().wait()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _slow_data_hook() -> None:
    """FAULT_SLOW_DATA=RANK:SECONDS: that rank's training loop waits SECONDS more for every batch."""
    rank, _, seconds = os.environ.get("FAULT_SLOW_DATA", "").partition(":")
    if not rank or int(os.environ.get("RANK", "0")) != int(rank):
        return
    from distribuuuu.training.state import Window

    real_next_batches = Window.next_batches

    def slowly(batches):
        for batch in batches:
            time.sleep(float(seconds))  # inside the wait the loop times: next() of this generator
            yield batch

    def next_batches(self, batches, count):
        return real_next_batches(self, slowly(batches), count)  # pulls ``count`` batches, each late

    Window.next_batches = next_batches


def _record_hooks() -> None:
    """FAULT_RECORD: what each step trained on, and the state a resume restored."""
    out = os.environ.get("FAULT_RECORD")
    if not out:
        return
    import json

    from distribuuuu.data.samplers import ResumableDistributedSampler

    real_iter, real_step, real_resume = (
        ResumableDistributedSampler.__iter__,
        trainer.train_step,
        trainer.resume_or_load_weights,
    )

    def sampler_iter(self):
        self.recorded, self.taken = list(real_iter(self)), 0
        return iter(self.recorded)

    def train_step(run, micro_batches, sums):
        sampler, n = run.train.sampler, sum(len(targets) for _, targets, _ in micro_batches)
        keys, sampler.taken = sampler.recorded[sampler.taken : sampler.taken + n], sampler.taken + n
        record = {
            "epoch": run.state.epoch, "step": run.state.step_in_epoch, "position": run.state.samples_in_epoch,
            "lr": run.optimizer.param_groups[0]["lr"], "keys": keys,
        }  # fmt: skip
        with open(os.path.join(out, f"steps_w{run.env.world_size}_r{run.env.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return real_step(run, micro_batches, sums)

    def resume_or_load_weights(run, checkpoints, path):
        real_resume(run, checkpoints, path)
        if path:
            _save_resumed_state(run, os.path.join(out, f"resumed_w{run.env.world_size}.pt"))

    ResumableDistributedSampler.__iter__ = sampler_iter
    trainer.train_step, trainer.resume_or_load_weights = train_step, resume_or_load_weights


def _save_resumed_state(run, path: str) -> None:
    """Rank 0 saves the run's whole state right after its resume (every rank gathers: collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from distribuuuu.checkpointing.sharded import _optimizer_by_index

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = get_state_dict(run.model, run.optimizer, options=options)
    ema = get_model_state_dict(run.ema.module, options=options) if run.ema is not None else None
    if run.env.rank == 0:
        progress = {"epoch": run.state.epoch, "step": run.state.step_in_epoch, "position": run.state.samples_in_epoch}
        torch.save({"model": model, "optimizer": _optimizer_by_index(optim), "ema": ema, **progress}, path)


if __name__ == "__main__":
    _signal_hook()
    _scaler_hook()
    _stalled_checkpoint_hook()
    _record_hooks()
    _slow_data_hook()
    # No end-of-run plot unless a test asks for it (LOG.PLOT True after it): ~1 s of every run.
    sys.exit(
        cli.run_tool(
            trainer.train_model, description=__doc__, build_cfg=lambda f, o: load_cfg(f, ["LOG.PLOT", "False", *o])
        )
    )
