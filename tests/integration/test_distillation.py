"""Knowledge distillation (DISTILL.*): the loss against closed forms; the teacher frozen, fed the
student's mixed images and named (never saved) in the checkpoint; DISTILL.ALPHA 0 bit-identical to
no teacher; bad teachers refused before training; a resume with another teacher refused; ddp and
fsdp on 2 ranks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    DDP_FSDP_REL,
    EVAL_TINY,
    REPO,
    TINY_ARCH,
    TRAIN,
    assert_ok,
    clean_env,
    in_process,
    run_torchrun,
)
from torch import nn

from distribuuuu import trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import load_cfg
from distribuuuu.losses import DistillationLoss
from distribuuuu.records.meters import MetricSums
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.distillation import weights_digest
from distribuuuu.training.parallelize import build_configured_model

# The tiny CNN for one epoch of 4 steps on synthetic 16 px images, with mixup and cutmix: their
# draws take part, so a teacher that moved the global RNG would show.
TINY_RUN = [*EVAL_TINY, "MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", "128", "TRAIN.BATCH_SIZE", "32",
            "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "2", "LOG.PROGRESS", "False", "LOG.PLOT", "False", "DATA.MIXUP_ALPHA", "0.2",
            "DATA.CUTMIX_ALPHA", "1.0", "OPTIM.BASE_LR", "0.1"]  # fmt: skip
JOB = str(REPO / "tests" / "scripts" / "distill_job.py")
BENCH = str(REPO / "tools" / "benchmark.py")


def closed_form_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ------------------------------------------------------------------------------------------------
# The loss, against closed forms in float64 (numpy: nothing shared with torch's kernels)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 4.0])
def test_soft_loss_is_one_minus_alpha_cross_entropy_plus_alpha_t2_kl_teacher_student(temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 5, generator=g, dtype=torch.float64) * 3, torch.randn(6, 5, generator=g) * 3
    target = torch.randint(0, 5, (6,), generator=g)
    alpha, t = 0.3, temperature
    s, te, y = student.numpy(), teacher.double().numpy(), target.numpy()
    ce = -np.mean(np.log(closed_form_softmax(s))[np.arange(6), y])
    p_t, p_s = closed_form_softmax(te / t), closed_form_softmax(s / t)
    kl = np.mean(np.sum(p_t * (np.log(p_t) - np.log(p_s)), axis=1))
    expected = (1 - alpha) * ce + alpha * t * t * kl
    loss = DistillationLoss(nn.CrossEntropyLoss(), alpha, t)(student, target, teacher)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # Planted bug: the KL the other way round (student || teacher) is another number
    reverse = np.mean(np.sum(p_s * (np.log(p_s) - np.log(p_t)), axis=1))
    assert abs((1 - alpha) * ce + alpha * t * t * reverse - expected) > 1e-3


def test_soft_terms_gradient_is_t_times_student_minus_teacher_probabilities_over_the_batch():
    """Hinton et al.: d(T^2 KL)/d(student logits) = T (softmax(s / T) - softmax(t / T)) / N."""
    g = torch.Generator().manual_seed(1)
    student = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    teacher, t = torch.randn(4, 7, generator=g, dtype=torch.float64) * 2, 3.0
    DistillationLoss(nn.CrossEntropyLoss(), 1.0, t)(student, torch.zeros(4, dtype=torch.long), teacher).backward()
    s = student.detach().numpy()
    expected = t * (closed_form_softmax(s / t) - closed_form_softmax(teacher.numpy() / t)) / 4
    np.testing.assert_allclose(student.grad.numpy(), expected, rtol=1e-10, atol=1e-14)


def test_hard_loss_is_cross_entropy_against_the_teachers_argmax_as_the_label():
    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g)
    soft_target = torch.softmax(torch.randn(8, 4, generator=g, dtype=torch.float64), 1)  # mixed labels
    log_p = np.log(closed_form_softmax(student.numpy()))
    task = -np.mean(np.sum(soft_target.numpy() * log_p, axis=1))
    hard = -np.mean(log_p[np.arange(8), teacher.numpy().argmax(1)])
    loss = DistillationLoss(nn.CrossEntropyLoss(), 0.5, temperature=4.0, hard=True)(student, soft_target, teacher)
    assert loss.item() == pytest.approx(0.5 * task + 0.5 * hard, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# Teachers: checkpoints of the tiny CNN written here (their weights need not be good)
# ------------------------------------------------------------------------------------------------
def write_teacher(path: Path, seed: int, num_classes: int = 10, arch: str = TINY_ARCH) -> Path:
    """A checkpoint as train_net.py writes one (weights, arch, classes, config) of a seeded tiny CNN."""
    cfg = load_cfg(None, [*EVAL_TINY, "MODEL.NUM_CLASSES", str(num_classes), "TRAIN.TOPK", "1"])
    torch.manual_seed(seed)
    model = build_configured_model(cfg.MODEL)
    classes = [str(i) for i in range(num_classes)]
    ckpt.save_checkpoint({"model": model.state_dict(), "arch": arch, "classes": classes, "cfg": cfg.dump()}, str(path))
    return path


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teachers")
    return {
        "a": write_teacher(root / "a.pth.tar", seed=10),
        "b": write_teacher(root / "b.pth.tar", seed=11),
        "five_classes": write_teacher(root / "five.pth.tar", seed=12, num_classes=5),
    }


def train_net(out: Path, *opts: str):
    return in_process(TRAIN, *TINY_RUN, "OUT_DIR", str(out), *opts)


def final_state(out: Path) -> dict:
    return ckpt.load_checkpoint(str(ckpt.list_checkpoints(str(out / ckpt.CKPT_DIR))[-1]))


@pytest.mark.slow  # launches, or trains, for 10-20 s: out of the quick tier
def test_alpha_0_trains_the_weights_of_a_run_without_teacher_bit_for_bit(tmp_path, teachers):
    alone, distilled, mixed = tmp_path / "alone", tmp_path / "alpha0", tmp_path / "alpha05"
    assert_ok(train_net(alone))
    assert_ok(train_net(distilled, "DISTILL.TEACHER", str(teachers["a"]), "DISTILL.ALPHA", "0.0"))
    assert_ok(train_net(mixed, "DISTILL.TEACHER", str(teachers["a"]), "DISTILL.ALPHA", "0.5"))
    a, d, m = final_state(alone), final_state(distilled), final_state(mixed)
    assert a["model"].keys() == d["model"].keys()
    assert all(torch.equal(a["model"][k], d["model"][k]) for k in a["model"]), "ALPHA 0 moved the weights"
    assert not all(torch.equal(a["model"][k], m["model"][k]) for k in a["model"]), "the test can fail"
    # The checkpoint names the teacher (path, hash of its weights) and holds nothing else of it
    assert "teacher" not in a, "a run without a teacher writes the checkpoint it always wrote"
    teacher_weights = ckpt.model_state_from(ckpt.load_checkpoint(str(teachers["a"])))
    assert m["teacher"]["path"] == str(teachers["a"]) and m["teacher"]["sha256"] == weights_digest(teacher_weights)
    assert m.keys() == a.keys() | {"teacher"} and m["model"].keys() == a["model"].keys()


def test_teacher_sees_the_students_mixed_images_and_its_weights_stay_unchanged(tmp_path, teachers):
    cfg = load_cfg(None, [*TINY_RUN, "OUT_DIR", str(tmp_path), "DISTILL.TEACHER", str(teachers["a"])])
    run = trainer.build_run(cfg, DistEnv())
    seen: dict[str, list] = {"teacher": [], "student": []}
    run.teacher.module.register_forward_hook(lambda m, args, out: seen["teacher"].append(args[0].clone()))
    run.forward_model.register_forward_hook(lambda m, args, out: seen["student"].append(args[0].clone()))
    before = run.teacher.digest()
    assert before == run.teacher.identity["sha256"]
    batches = iter(run.train.loader)
    run.forward_model.train()
    for _ in range(3):
        trainer.train_step(run, [next(batches)], MetricSums(run.env.device, run.cfg.TRAIN.TOPK))
    assert len(seen["teacher"]) == 3 and all(torch.equal(t, s) for t, s in zip(seen["teacher"], seen["student"]))
    raw = next(iter(run.train.loader))[0].float()
    assert not torch.equal(seen["student"][0], raw), "mixup/cutmix changed the images (the comparison means something)"
    assert run.teacher.digest() == before, "the teacher's weights (BatchNorm statistics included) changed"
    assert not run.teacher.module.training and not any(p.requires_grad for p in run.teacher.module.parameters())
    optimized = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert optimized.isdisjoint(id(p) for p in run.teacher.module.parameters())


def test_benchmark_breakdown_times_the_teachers_forward_apart(teachers):
    opts = ["--what", "breakdown", "--steps", "3", "--warmup", "1", *EVAL_TINY, "TRAIN.BATCH_SIZE", "16"]
    result = in_process(BENCH, *opts, "DISTILL.TEACHER", str(teachers["a"]))
    assert_ok(result)
    record = next(json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    assert record["what"] == "breakdown" and record["teacher_arch"] == TINY_ARCH and record["teacher_ms"] > 0
    assert f"teacher ({TINY_ARCH}) fwd" in result.stdout


# ------------------------------------------------------------------------------------------------
# Bad teachers: one line naming the key, exit 2, before anything is written
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts, names",
    [
        (["DISTILL.TEACHER", "{missing}"], "DISTILL.TEACHER: no checkpoint file or .dcp folder"),
        (["DISTILL.TEACHER", "{five_classes}"], "DISTILL.TEACHER: {five_classes} predicts 5 classes"),
        (["DISTILL.TEACHER", "{a}", "DISTILL.ARCH", "resnet18"], "DISTILL.TEACHER: {a} does not fit resnet18"),
        (["DISTILL.TEACHER", "{a}", "DISTILL.WEIGHTS_KIND", "ema"], "DISTILL.WEIGHTS_KIND"),
        (["DISTILL.ARCH", "resnet18"], "DISTILL.ARCH needs DISTILL.TEACHER"),
        (["DISTILL.SHARD_TEACHER", "True"], "DISTILL.SHARD_TEACHER needs DIST.STRATEGY fsdp"),
        (["DISTILL.TEACHER", "{a}", "MODEL.TASK", "multilabel"], "DISTILL.TEACHER distils a softmax"),
    ],
)
def test_a_bad_teacher_is_one_line_naming_the_key_exit_2_before_training(tmp_path, teachers, opts, names):
    paths = {**{k: str(v) for k, v in teachers.items()}, "missing": str(tmp_path / "nowhere.pth.tar")}
    out = tmp_path / "out"
    result = train_net(out, *(o.format(**paths) for o in opts))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and names.format(**paths) in lines[0], result.stderr[-2000:]
    assert not (out / ckpt.CKPT_DIR).exists()


def test_resume_refuses_another_teacher_and_takes_the_same_weights_at_another_path(tmp_path, teachers):
    out = tmp_path / "out"
    two_epochs = ["OPTIM.MAX_EPOCH", "2", "DISTILL.TEACHER"]
    assert_ok(train_net(out, *two_epochs, str(teachers["a"]), "TRAIN.STOP_AFTER_EPOCHS", "1"))
    refused = train_net(out, *two_epochs, str(teachers["b"]))
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "DISTILL.TEACHER" in lines[0] and str(teachers["a"]) in lines[0], lines
    without = train_net(out, "OPTIM.MAX_EPOCH", "2")
    assert without.returncode == 2 and "no teacher" in without.stderr
    moved = shutil.copy(teachers["a"], tmp_path / "moved.pth.tar")  # the same teacher: its weights, not its path
    assert_ok(train_net(out, *two_epochs, str(moved)))
    assert final_state(out)["epoch"] == 2


# ------------------------------------------------------------------------------------------------
# 2 ranks: ddp, fsdp with the teacher replicated, fsdp with the teacher sharded (one launch)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_distilled_runs_train_under_ddp_and_fsdp_on_2_ranks_with_the_teacher_replicated_or_sharded(tmp_path, teachers):
    report = tmp_path / "report.json"
    result = run_torchrun(2, JOB, str(report), str(tmp_path), str(teachers["a"]), timeout=400, env=clean_env())
    assert_ok(result)
    runs = json.loads(report.read_text())
    for name, r in runs.items():
        # A random teacher: the labels teach (3 epochs of the tiny CNN at 16 px reached 38.5% here; chance: 10%)
        assert r["top1"] > 25, f"{name} did not train: {r}"
        assert r["last_loss"] < r["first_loss"], f"{name}: {r}"
        assert r["teacher"]["sha256"] == weights_digest(ckpt.model_state_from(ckpt.load_checkpoint(str(teachers["a"]))))
    ddp, fsdp, sharded = (ckpt.load_checkpoint(runs[k]["checkpoint"])["model"] for k in ("ddp", "fsdp", "fsdp_sharded"))
    for key, weights in ddp.items():
        if weights.is_floating_point():
            scale = max(weights.abs().max().item(), 1e-30)
            assert (fsdp[key] - weights).abs().max().item() <= DDP_FSDP_REL * scale, key
            # The sharded teacher all-gathers the very fp32 weights the replicated one holds
            assert torch.equal(sharded[key], fsdp[key]), key
    assert math.isfinite(runs["ddp"]["last_loss"])
