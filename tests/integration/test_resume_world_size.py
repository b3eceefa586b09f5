"""Resume on another world size, exactly, under ddp and fsdp: one epoch trained by 2, then 3 (then 2) ranks.

Each chain is one epoch of the digits with tests/models.py's tiny CNN (16 px), preempted
(SIGTERM) mid-epoch by 2 ranks and resumed by 3 ranks, which are preempted in turn; the fsdp chain
is finished by 2 ranks (a sharded checkpoint of 3 ranks read by 2). ``FAULT_RECORD`` makes every
rank record the sampler keys each step trained on, the LR and the global sample position, and rank
0 save the state each resume restored. The chains check, together: every sample of the interrupted
epoch used once, the LR at each step the schedule's at that sample position, the resumed weights,
optimizer and EMA state identical to the checkpoint's, and ddp and fsdp resumed on 3 ranks saving
the same weights (accumulation and clipping included: the trainer's own step path). Last, hsdp
through the trainer on two nodes of 2 ranks (two torchrun agents).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DDP_FSDP_REL,
    REPO,
    TINY_TRAIN,
    assert_ok,
    clean_env,
    in_process,
    read_metrics,
    run_torchrun,
    two_nodes,
)
from torch import nn
from torch.distributed.fsdp import fully_shard

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import get_cfg_defaults, load_cfg
from distribuuuu.models import register_model
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training import resume as state
from distribuuuu.training import run as run_setup
from distribuuuu.training.optim import lr_at
from distribuuuu.training.session import Session
from distribuuuu.training.state import Run

DIGITS = REPO / "data" / "digits"
BATCH, ACCUM = 16, 2
CHAIN = [
    "MODEL.ARCH", "tiny_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "1",
    "TRAIN.DATASET", str(DIGITS), "TEST.DATASET", str(DIGITS), "OPTIM.EMA_DECAY", "0.9", "DATA.MIXUP_ALPHA", "0.2",
    "TRAIN.BATCH_SIZE", str(BATCH), "TRAIN.ACCUM_STEPS", str(ACCUM), "TRAIN.CLIP_GRAD_NORM", "0.5",
    "TRAIN.PRINT_FREQ", "3", "TRAIN.WORKERS", "1", "TRAIN.KEEP_CKPTS", "3",  # each segment's checkpoint is read
    "TEST.BATCH_SIZE", "4",  # 361 val images on 2 ranks: 46 and 45 batches, so fsdp's eval pads one forward
]  # fmt: skip
# (ranks, FAULT_SIGNAL_AT_STEP): the ranks stop at the next PRINT_FREQ sync point after that step.
# Step numbers count the optimizer steps taken in the epoch, over all segments: 2 ranks stop at
# step 6 (sample 384), 3 ranks take steps 7-9 (to sample 672) and stop; under fsdp 2 ranks finish
# the epoch. (The ddp chain stops there: its step-9 checkpoint is the one compared with fsdp's.)
SEGMENTS = {"ddp": [(2, 5), (3, 7)], "fsdp": [(2, 5), (3, 7), (2, 0)]}
RESUMES = {"ddp": [(3, 6)], "fsdp": [(3, 6), (2, 9)]}  # (world size, the step its checkpoint was saved at)


def _chain(root: Path, strategy: str) -> Path:
    out, record = root / "out", root / "record"
    record.mkdir(parents=True)
    for ranks, signal_at in SEGMENTS[strategy]:
        env = clean_env(FAULT_RECORD=str(record), FAULT_SIGNAL_AT_STEP=str(signal_at))
        args = ("OUT_DIR", str(out), *CHAIN, "DIST.STRATEGY", strategy)
        result = run_torchrun(ranks, TINY_TRAIN, *args, timeout=300, env=env)
        preempted = signal_at and "exiting with 75" in result.stderr
        assert result.returncode == 0 or preempted, f"{ranks} ranks:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return root


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, Path]:
    """Both strategies' chains: the tests read their records."""
    return {s: _chain(tmp_path_factory.mktemp(s), s) for s in ("ddp", "fsdp")}


def _steps(record: Path, world: int) -> list[dict]:
    """Every step a segment of ``world`` ranks took, its keys joined over ranks (rank order)."""
    per_rank = [
        [json.loads(line) for line in (record / f"steps_w{world}_r{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    ]
    steps = []
    for records in zip(*per_rank):
        assert len({(s["step"], s["position"], s["lr"]) for s in records}) == 1, "ranks disagree on the step"
        steps.append(dict(records[0], keys=[k for s in records for k in s["keys"]]))
    return steps


def _segments(record: Path) -> list[list[dict]]:
    """The steps of each segment in order: 2-rank steps split where the position jumps (fsdp's last segment)."""
    two, three = _steps(record, 2), _steps(record, 3)
    jumps = [i for i in range(1, len(two)) if two[i]["position"] != two[i - 1]["position"] + BATCH * ACCUM * 2]
    if not jumps:
        return [two, three]
    return [two[: jumps[0]], three, two[jumps[0] :]]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_epoch_across_world_sizes_uses_each_sample_once_at_the_schedules_lr(chains, strategy):
    segments = _segments(chains[strategy] / "record")
    n = sum(1 for f in (DIGITS / "train").rglob("*") if f.is_file())
    optim = get_cfg_defaults().OPTIM
    optim.MAX_EPOCH = 1
    position = 0
    assert len(segments) == len(SEGMENTS[strategy])
    for steps, (world, _) in zip(segments, SEGMENTS[strategy]):
        batch = BATCH * ACCUM * world
        steps_per_epoch = math.ceil(n / world) // (BATCH * ACCUM)  # DistributedSampler's share, drop_last
        assert steps and steps[0]["position"] == position, "each segment starts where the last one stopped"
        for s in steps:
            assert s["position"] == position and len(s["keys"]) == batch
            expected = lr_at(position / batch, steps_per_epoch, optim)  # the fraction of this run's epoch
            assert s["lr"] == pytest.approx(expected, rel=1e-12), (world, position)
            position += batch
    if SEGMENTS[strategy][-1][1] == 0:  # the last segment was not stopped: it finished the epoch
        assert n - position < BATCH * ACCUM * 2, "the epoch ran to its drop_last tail"
    indices = [index for steps in segments for s in steps for epoch, index in s["keys"]]
    assert len(indices) == len(set(indices)) == position, "a sample of the interrupted epoch was used twice"
    order = torch.randperm(n, generator=torch.Generator().manual_seed(get_cfg_defaults().RNG_SEED)).tolist()
    assert set(indices) == set(order[:position]), "the epoch's permutation, from its start, without a gap"


def _assert_equal_states(resumed: dict, saved: dict, rel: float = 0.0) -> None:
    """Model, EMA and momentum equal, or each tensor within ``rel`` of its largest absolute value."""
    for name, a, b in (
        ("model", resumed["model"], ckpt.model_state_from(saved)),
        ("ema", resumed["ema"], saved["ema"]["module"]),
        ("momentum", resumed["optimizer"]["state"], saved["optimizer"]["state"]),
    ):
        assert a.keys() == b.keys(), name
        for key in a:
            x, y = (a[key], b[key]) if name != "momentum" else (a[key]["momentum_buffer"], b[key]["momentum_buffer"])
            atol = rel * y.float().abs().max().item() if y.numel() else 0.0
            assert x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=0, atol=atol), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resumed_on_another_world_size_with_the_checkpoints_weights_optimizer_and_ema(chains, strategy):
    root, suffix = chains[strategy], ".dcp" if strategy == "fsdp" else ".pth.tar"
    for world, saved_at in RESUMES[strategy]:  # 2 ranks' checkpoint into 3 ranks (fsdp: then 3 ranks' into 2)
        resumed = torch.load(root / "record" / f"resumed_w{world}.pt", weights_only=True)
        path = root / "out" / "checkpoints" / ckpt.checkpoint_name(1, saved_at).replace(".pth.tar", suffix)
        saved = ckpt.load_checkpoint(str(path))  # a .dcp directory reads whole, as a file would
        assert (resumed["epoch"], resumed["step"], resumed["position"]) == (0, saved_at, saved["samples_in_epoch"])
        _assert_equal_states(resumed, saved)


@pytest.mark.slow
def test_ddp_and_fsdp_resumed_on_3_ranks_save_the_same_weights(chains):
    """Both chains' checkpoints at step 9, saved by 3 ranks resumed from 2 ranks' step-6 checkpoint."""
    name = ckpt.checkpoint_name(1, 9)
    saved = {
        "ddp": ckpt.load_checkpoint(str(chains["ddp"] / "out" / "checkpoints" / name)),
        "fsdp": ckpt.load_checkpoint(str(chains["fsdp"] / "out" / "checkpoints" / name.replace(".pth.tar", ".dcp"))),
    }
    assert saved["fsdp"]["model"].keys() == saved["ddp"]["model"].keys()
    resumed_like = {
        "model": saved["fsdp"]["model"],
        "ema": saved["fsdp"]["ema"]["module"],
        "optimizer": saved["fsdp"]["optimizer"],
    }
    _assert_equal_states(resumed_like, saved["ddp"], rel=DDP_FSDP_REL)


@pytest.mark.slow
def test_fsdp_evaluates_uneven_shards_to_the_end_seeing_every_val_image_once(chains):
    val = [r for r in read_metrics(chains["fsdp"] / "out") if r["split"] == "val"]
    assert [(r["weights"], r["samples"]) for r in val] == [("model", 361), ("ema", 361)]


@pytest.fixture(scope="module")
def hsdp_two_nodes(tmp_path_factory) -> list[Path]:
    """An hsdp job as two nodes of 2 ranks (two torchrun agents), one epoch; each node's OUT_DIR."""
    root = tmp_path_factory.mktemp("hsdp_two_nodes")
    outs = [root / "node0", root / "node1"]
    opts = [*CHAIN, "TRAIN.CKPT_PERIOD_ITERS", "4", "DIST.STRATEGY", "hsdp"]
    for result in two_nodes(2, TINY_TRAIN, [["OUT_DIR", str(out), *opts] for out in outs]):
        assert_ok(result)
    return outs


@pytest.mark.slow
def test_hsdp_on_two_nodes_of_2_ranks_meshes_by_node_and_only_global_rank_0_writes(hsdp_two_nodes):
    """hsdp through the trainer: a (2 nodes x 2 ranks) mesh, sharded within a node, replicated
    across (tests/integration/test_fsdp_runs.py checks that such a mesh trains ddp's weights). Each node has its own
    OUT_DIR: the node whose LOCAL_RANK 0 is global rank 0 writes everything, the other nothing.
    c10d rendezvous gives node ranks in order of arrival, so which agent holds global rank 0 is
    found from the outputs, as on a real cluster."""
    written = [out for out in hsdp_two_nodes if out.exists() and any(out.rglob("*"))]
    assert len(written) == 1, {str(out): sorted(map(str, out.rglob("*"))) for out in written}
    out = written[0]
    log = (out / "log.txt").read_text()
    assert "DIST.STRATEGY hsdp: mesh (2, 2)" in log
    table = re.findall(r"^\s*(\d+)\s+\S+\s+(\d+)\s+(?:cpu|cuda:\d+)$", log, flags=re.M)
    assert table == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")], log[:2000]  # global rank, LOCAL_RANK
    final = ckpt.load_checkpoint(str(out / "checkpoints" / "ckpt_ep_001.dcp"))  # a .dcp directory reads whole
    assert final["epoch"] == 1 and final["model"].keys() == final["ema"]["module"].keys()
    val = [r for r in read_metrics(out) if r["split"] == "val"]
    assert [(r["weights"], r["samples"]) for r in val] == [("model", 361), ("ema", 361)]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ------------------------------------------------------------------------------------------------
# In-process: the edges of a resume that need no second process
# ------------------------------------------------------------------------------------------------
@register_model("resume_edge_cnn")
def resume_edge_cnn(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
    )


def _edge_run(tmp_path: Path, *opts: str) -> Run:
    edge = ["MODEL.ARCH", "resume_edge_cnn", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.WORKERS", "0"]
    cfg = load_cfg(None, [*edge, "TRAIN.BATCH_SIZE", str(BATCH), "OUT_DIR", str(tmp_path), *opts])
    return run_setup.build_run(cfg, DistEnv())


def test_a_checkpoint_without_a_sample_position_resumes_at_its_steps_times_its_global_batch(tmp_path, caplog):
    """Checkpoints written before they recorded ``samples_in_epoch`` and ``global_batch`` (by 2
    ranks of batch 16 x accumulation 2 here) resume at step x the global batch their config and
    world size give, and a run of another global batch says what that changes."""
    run = _edge_run(tmp_path)
    saved = state.training_state(run)
    saved_cfg = load_cfg(None, ["TRAIN.BATCH_SIZE", str(BATCH), "TRAIN.ACCUM_STEPS", str(ACCUM)])
    saved.update(step_in_epoch=7, epoch=1, world_size=2, cfg=saved_cfg.dump(), steps_per_epoch=22)
    del saved["samples_in_epoch"], saved["global_batch"]
    with caplog.at_level("WARNING", logger="distribuuuu"):
        state.restore_progress(run, saved)
    assert (run.state.epoch, run.state.step_in_epoch) == (1, 7)
    assert run.state.samples_in_epoch == 7 * BATCH * ACCUM * 2
    assert f"global batch changed from {BATCH * ACCUM * 2} (2 rank(s)) to {BATCH}" in caplog.text
    assert f"continues at sample {7 * BATCH * ACCUM * 2}" in caplog.text


def test_a_single_file_checkpoint_is_refused_by_a_sharded_run_with_the_conversion_to_run(tmp_path):
    run = _edge_run(tmp_path)
    path = state.save_training_checkpoint(run, state.checkpointer(run.cfg))  # a ddp run's single file
    assert path.endswith(".pth.tar") and ckpt.list_checkpoints(str(tmp_path / ckpt.CKPT_DIR)) == [path]
    sharded = _edge_run(tmp_path, "DIST.STRATEGY", "fsdp")  # one process trains its plain model...
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(sharded.model)  # ...so shard it here, as shard_for_training does with several ranks
        with pytest.raises(ckpt.CheckpointError) as refused:
            state.resume_or_load_weights(sharded, state.checkpointer(sharded.cfg), path)
    finally:
        dist.destroy_process_group()
    message = str(refused.value)
    assert "DIST.STRATEGY fsdp shards the model" in message
    assert f"tools/convert_checkpoint.py {path} {path.replace('.pth.tar', '.dcp')}" in message


def test_an_epoch_resumed_with_another_global_batch_counts_to_its_own_last_step(tmp_path, caplog):
    """Saved by 2 ranks of 16 x 2 after 7 steps (sample 448), the epoch goes on at 16 a step: its
    steps keep counting from 7 (checkpoint names stay ordered) to 7 + (1436 - 448) // 16 = 68, so
    the windows read k/68 and the last, 68/68, has nothing left to wait for (not 68/89)."""
    run = _edge_run(tmp_path, "TRAIN.PRINT_FREQ", "20", "OPTIM.MAX_EPOCH", "1")
    saved = state.training_state(run)
    saved.update(step_in_epoch=7, samples_in_epoch=7 * BATCH * ACCUM * 2, global_batch=BATCH * ACCUM * 2, world_size=2)
    state.restore_progress(run, saved)
    with caplog.at_level("INFO", logger="distribuuuu.trainer"):
        trainer.train_epoch(run, Session(run.cfg, env=run.env), 0)
    windows = re.findall(r"step (\d+)/(\d+) .* eta (\S+)", caplog.text)
    last = 7 + (1436 - 7 * BATCH * ACCUM * 2) // BATCH
    assert [(int(s), int(n)) for s, n, _ in windows] == [(20, last), (40, last), (60, last), (last, last)]
    assert windows[-1][2] == "0:00:00"


@pytest.mark.parametrize("strategy, taken", [("fsdp", ".dcp"), ("ddp", ".pth.tar")])
def test_a_checkpoint_converted_beside_its_file_is_the_one_a_sharded_run_resumes_from(tmp_path, strategy, taken):
    """The conversion the refusal above asks for leaves both formats of one epoch in checkpoints/:
    a run resumes from the one its DIST.STRATEGY writes, whichever the folder lists first."""
    run = _edge_run(tmp_path)
    path = state.save_training_checkpoint(run, state.checkpointer(run.cfg))
    assert_ok(in_process(str(REPO / "tools" / "convert_checkpoint.py"), path, path.replace(".pth.tar", ".dcp")))
    cfg = _edge_run(tmp_path, "DIST.STRATEGY", strategy).cfg
    assert state.find_checkpoint_to_resume(cfg).path == path.replace(".pth.tar", taken)
