"""A run's records are its own: every evaluation record names the checkpoint it evaluated (path,
epoch, the weights' SHA-256 prefix), test_net.py without OUT_DIR writes beside its checkpoint and
takes the folder's lock, a fresh run moves an earlier run's outputs aside, a resume moves the
records past its checkpoint aside, and a resumed epoch's record is the whole epoch's."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from helpers import DUMMY_OPTS, REPO, TEST, TINY_TRAIN, assert_ok, in_process, read_metrics
from models import TINY_ARCH

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.records.out_dir_lock import OutDirLock

SUMMARIZE = str(REPO / "tools" / "summarize.py")
STEPS_PER_EPOCH = 4  # DUMMY_OPTS: 64 images, batch 16, one process
# Two epochs of the tiny CNN on synthetic data, a checkpoint every 2 steps (all kept), precise BN.
OPTS = [
    *DUMMY_OPTS, "MODEL.ARCH", TINY_ARCH, "TRAIN.WORKERS", "0", "OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_ITERS", "2",
    "TRAIN.KEEP_CKPTS", "10", "BN.PRECISE_IMAGES", "32",
]  # fmt: skip


def sha256_of(weights: dict) -> str:
    """The SHA-256 of a model's tensors' bytes, by sorted name (computed here, not by the package)."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(weights[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def weights_of(path: Path) -> dict:
    return ckpt.model_state_from(ckpt.load_checkpoint(str(path)))


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory) -> Path:
    """OUT_DIR of an uninterrupted run of OPTS (tests copy it before writing)."""
    out = tmp_path_factory.mktemp("two_epochs") / "run"
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *OPTS))
    return out


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def split_epochs(records: list[dict]) -> list[tuple[str, int]]:
    return [(r["split"], r["epoch"]) for r in records]


# ------------------------------------------------------------------------------------------------
# Every evaluation record names the checkpoint it evaluated
# ------------------------------------------------------------------------------------------------
def test_each_val_record_names_the_checkpoint_that_holds_the_weights_it_evaluated(two_epochs):
    vals = [r for r in read_metrics(two_epochs) if r["split"] == "val"]
    assert [r["epoch"] for r in vals] == [1, 2]
    for r in vals:
        path = two_epochs / "checkpoints" / ckpt.checkpoint_name(r["epoch"])
        assert r["checkpoint"]["path"] == str(path) and r["checkpoint"]["epoch"] == r["epoch"]
        assert (
            sha256_of(weights_of(path)).startswith(r["checkpoint"]["sha256"]) and len(r["checkpoint"]["sha256"]) >= 12
        )


def test_test_net_without_out_dir_writes_beside_its_checkpoint_and_names_it(two_epochs, tmp_path):
    """Not into the default OUT_DIR (output/digits, relative to where it runs): a later fresh run
    there would have read its record as its own."""
    weights = shutil.copy(two_epochs / "best.pth.tar", tmp_path / "best.pth.tar")
    result = in_process(TEST, "MODEL.WEIGHTS", str(weights), cwd=tmp_path)
    assert_ok(result)
    assert not (tmp_path / "output").exists(), "nothing in the training default's OUT_DIR"
    [record] = read_metrics(tmp_path / "eval_best")
    state = ckpt.load_checkpoint(str(weights))
    assert record["split"] == "test" and record["checkpoint"]["path"] == str(weights)
    assert record["checkpoint"]["epoch"] == state["epoch"]
    assert sha256_of(ckpt.model_state_from(state)).startswith(record["checkpoint"]["sha256"])
    assert f"recorded in {tmp_path / 'eval_best'}/metrics.jsonl" in result.stdout


def test_test_net_into_a_folder_another_run_holds_is_one_line_and_writes_nothing(two_epochs, tmp_path):
    held = tmp_path / "training"
    held.mkdir()
    lock = OutDirLock(str(held), stale_s=600)
    lock.acquire()  # a live holder: this process, as a training run into that folder would be
    try:
        result = in_process(TEST, "MODEL.WEIGHTS", str(two_epochs / "best.pth.tar"), "OUT_DIR", str(held))
    finally:
        lock.release()
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"OUT_DIR {held} is in use by another run" in line
    assert sorted(p.name for p in held.iterdir()) == [], "nothing written into the held folder"


def test_the_summary_gives_a_test_of_weights_the_run_never_evaluated_as_not_its_own(two_epochs, tmp_path):
    out = copy_run(two_epochs, tmp_path / "run")
    other = copy_run(two_epochs, tmp_path / "other")
    weights = two_epochs / "checkpoints" / ckpt.checkpoint_name(1, 2)  # mid-epoch weights: never evaluated
    for weights_path in (out / "best.pth.tar", weights):
        assert_ok(in_process(TEST, "MODEL.WEIGHTS", str(weights_path), "OUT_DIR", str(other)))
    text = in_process(SUMMARIZE, str(other), "--no-write").stdout
    [own, foreign] = [line for line in text.splitlines() if line.startswith("- test")]
    assert "best.pth.tar" in own and "not this run's" not in own, text
    assert ckpt.checkpoint_name(1, 2) in foreign and "not this run's" in foreign, text


def test_a_flip_tta_test_is_recorded_logged_and_summarised_as_such_beside_the_plain_one(two_epochs, tmp_path):
    """The same weights with and without TEST.TTA flip are two measurements: the record says which
    (``tta``), the log line too, and the summary keeps and names both."""
    out = copy_run(two_epochs, tmp_path / "run")
    weights = str(out / "best.pth.tar")
    plain = in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", str(out))
    flipped = in_process(TEST, "MODEL.WEIGHTS", weights, "OUT_DIR", str(out), "TEST.TTA", "flip")
    assert_ok(plain) and assert_ok(flipped)
    assert "flip TTA" in flipped.stdout + flipped.stderr and "TTA" not in plain.stdout + plain.stderr
    tests = [r for r in read_metrics(out) if r["split"] == "test"]
    assert [r.get("tta") for r in tests] == [None, "flip"]
    text = in_process(SUMMARIZE, str(out), "--no-write").stdout
    lines = [line for line in text.splitlines() if line.startswith("- test")]
    assert len(lines) == 2 and "flip TTA" in lines[1] and "TTA" not in lines[0], text


def test_the_summary_names_best_pth_tar_for_a_best_whose_epoch_checkpoint_was_pruned(two_epochs, tmp_path):
    """TRAIN.KEEP_CKPTS prunes the best epoch's checkpoint: the summary's best line points at
    best.pth.tar, which holds those weights, not at a file that is gone."""
    out = copy_run(two_epochs, tmp_path / "run")
    [best] = [r for r in read_metrics(out) if r["split"] == "val" and r.get("best")][-1:]
    pruned = Path(best["checkpoint"]["path"].replace(str(two_epochs), str(out)))
    assert pruned.exists() and sha256_of(weights_of(out / "best.pth.tar")).startswith(best["checkpoint"]["sha256"])
    metrics = out / "metrics.jsonl"  # the copy's records name the copy's files, as the run's own would
    metrics.write_text(metrics.read_text().replace(str(two_epochs), str(out)))
    pruned.unlink()
    text = in_process(SUMMARIZE, str(out), "--no-write").stdout
    [line] = [line for line in text.splitlines() if line.startswith("- best val")]
    assert f"best.pth.tar (its checkpoint checkpoints/{pruned.name} pruned since)" in line, text


# ------------------------------------------------------------------------------------------------
# A fresh run moves an earlier run's outputs aside
# ------------------------------------------------------------------------------------------------
def test_a_fresh_run_into_a_folder_of_records_without_checkpoints_moves_them_aside(two_epochs, tmp_path):
    out = tmp_path / "out"
    assert_ok(in_process(TEST, "MODEL.WEIGHTS", str(two_epochs / "best.pth.tar"), "OUT_DIR", str(out)))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "metrics.jsonl" in before

    result = in_process(TINY_TRAIN, "OUT_DIR", str(out), *OPTS, "OPTIM.MAX_EPOCH", "1")
    assert_ok(result)
    assert "test" not in [r["split"] for r in read_metrics(out)], "the new run's records only"
    [aside] = list((out / "previous").iterdir())
    assert {name: (aside / name).read_bytes() for name in before} == before, "moved whole, not deleted"
    [said] = [line for line in result.stdout.splitlines() if "moved" in line and str(aside) in line]
    assert "metrics.jsonl" in said
    assert "test (test_net.py)" not in (out / "summary.md").read_text()


# ------------------------------------------------------------------------------------------------
# A resume: each (split, epoch) once, and a resumed epoch's record is the whole epoch's
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(two_epochs, tmp_path_factory) -> Path:
    """two_epochs resumed from its checkpoint 2 steps into epoch 1, as after a kill there (the later
    checkpoints removed; every record the killed run wrote past that point left in metrics.jsonl)."""
    out = copy_run(two_epochs, tmp_path_factory.mktemp("resumed") / "run")
    for path in (out / "checkpoints").iterdir():
        if path.name != ckpt.checkpoint_name(1, 2):
            path.unlink()
    assert_ok(in_process(TINY_TRAIN, "OUT_DIR", str(out), *OPTS))
    return out


def test_a_resume_keeps_each_split_and_epoch_once_and_moves_the_records_past_it_aside(two_epochs, resumed):
    records = read_metrics(resumed)
    assert split_epochs(records) == split_epochs(read_metrics(two_epochs)) == [
        ("train", 1), ("val", 1), ("train", 2), ("val", 2)
    ]  # fmt: skip
    [aside] = list((resumed / "previous").iterdir())
    assert (aside / "metrics.jsonl").read_bytes() == (two_epochs / "metrics.jsonl").read_bytes(), (
        "every record past the checkpoint (all of them: it is in epoch 1) moved aside as written"
    )
    for r in records:  # the rerun's: its val records name the rerun's checkpoints
        if r["split"] == "val":
            path = resumed / "checkpoints" / ckpt.checkpoint_name(r["epoch"])
            assert sha256_of(weights_of(path)).startswith(r["checkpoint"]["sha256"])
    log = (resumed / "log.txt").read_text()
    assert f"resumed from {resumed / 'checkpoints' / ckpt.checkpoint_name(1, 2)} at epoch 1, step 2" in log


def test_a_resumed_epochs_record_sums_the_interrupted_part_and_says_it_was_resumed(two_epochs, resumed):
    whole = {r["epoch"]: r for r in read_metrics(two_epochs) if r["split"] == "train"}
    again = {r["epoch"]: r for r in read_metrics(resumed) if r["split"] == "train"}
    assert again[1]["samples"] == whole[1]["samples"] == STEPS_PER_EPOCH * 16
    # Bit-identical resume: the same windows' sums, so the same means as the uninterrupted epoch's.
    for key in ("loss", "top1", "step", "nonfinite_steps"):
        assert again[1][key] == pytest.approx(whole[1][key], rel=1e-12), key
    assert again[1]["resumed_at_steps"] == [2] and "resumed_at_steps" not in again[2]
    assert "resumed_at_steps" not in whole[1]


def test_the_summary_lists_the_starts_and_the_training_and_precise_bn_time(resumed):
    records = read_metrics(resumed)
    text = (resumed / "summary.md").read_text()
    starts = sorted(p.name for p in (resumed / "starts").iterdir())
    assert len(starts) == 2
    [line] = [line for line in text.splitlines() if line.startswith("- starts:")]
    assert line.startswith("- starts: 2 ") and "a new run" in line
    assert f"resumed from {resumed / 'checkpoints' / ckpt.checkpoint_name(1, 2)}" in line
    precise = sum(r["precise_bn_s"] for r in records if "precise_bn_s" in r)
    assert precise > 0 and len([r for r in records if "precise_bn_s" in r]) == 2  # one per evaluated epoch
    train_s = sum(r["time_s"] for r in records if r["split"] == "train")
    assert f"- time: {train_s:.1f} s training over 2 starts" in text and f"{precise:.1f} s precise BN" in text
