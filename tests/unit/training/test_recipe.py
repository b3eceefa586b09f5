"""The training recipe: precision, compile, accumulation, clipping, EMA, mixing, optimizers, ZeRO, LR schedule.

Each test compares the trainer with an independent computation: a closed form, a hand-computed
update, or a second run that must give the same weights by another route (k micro-batches vs one
batch k times larger; ZeRO-1 vs unsharded).

The real runs of the entry point (2-process gloo jobs, ZeRO-1, bf16, compile), launched through the
worker tests/scripts/recipe_job.py: tests/integration/test_recipe_runs.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from helpers import REPO
from recipe_helpers import TINY, RecipeCNN
from torch import nn

from distribuuuu import trainer
from distribuuuu.config import get_cfg_defaults, load_cfg
from distribuuuu.models import register_model
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.ema import ModelEMA
from distribuuuu.training.optim import LARS, build_optimizer, lr_at, optimizer_groups, scaled_base_lr
from distribuuuu.training.preprocessing import build_batch_mixer

DIGITS = REPO / "data" / "digits"

# Filled by the model's logits hook; the worker (tests/scripts/recipe_job.py) has its own, written out when it exits.
STATS: dict = {"steps": 0, "allreduces": 0, "state_elements": [], "param_dtypes": [], "logits_dtypes": [], "ema": []}


def _record_logits_dtype(module: nn.Module, inputs, output: torch.Tensor) -> None:
    if module.training and str(output.dtype) not in STATS["logits_dtypes"]:
        STATS["logits_dtypes"].append(str(output.dtype))


@register_model("recipe_cnn")
def recipe_cnn(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    model = RecipeCNN(num_classes)
    model.register_forward_hook(_record_logits_dtype)
    return model


# ------------------------------------------------------------------------------------------------
# In-process tests on a real Run (built by trainer.build_run on data/digits, no process group)
# ------------------------------------------------------------------------------------------------
def make_run(tmp_path: Path, *opts: str) -> trainer.Run:
    """A training Run of the tiny model on data/digits in this process, seeded."""
    cfg = load_cfg(None, [*TINY, "OUT_DIR", str(tmp_path), *opts])
    torch.manual_seed(0)
    return trainer.build_run(cfg, DistEnv())


def micro_batches(run: trainer.Run, count: int) -> list:
    """The first ``count`` training batches of the run's loader."""
    batches = iter(run.train.loader)
    return [next(batches) for _ in range(count)]


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def sums_for(run: trainer.Run):
    from distribuuuu.records.meters import MetricSums

    return MetricSums(run.env.device, run.cfg.TRAIN.TOPK)


def test_k_micro_batches_give_the_update_of_one_batch_k_times_larger(tmp_path):
    accum = make_run(tmp_path, "TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", "2")
    large = make_run(tmp_path, "TRAIN.BATCH_SIZE", "32")
    half = make_run(tmp_path, "TRAIN.BATCH_SIZE", "16")
    assert torch.equal(flat_weights(accum.model), flat_weights(large.model))
    start = flat_weights(accum.model)
    batches = micro_batches(accum, 4)
    for step in range(2):  # two steps: momentum and weight decay take part too
        pair = batches[2 * step : 2 * step + 2]
        trainer.train_step(accum, pair, sums_for(accum))
        joined = (torch.cat([b[0] for b in pair]), torch.cat([b[1] for b in pair]), 0)
        trainer.train_step(large, [joined], sums_for(large))
        trainer.train_step(half, pair[:1], sums_for(half))
    moved = flat_weights(large.model) - start
    assert torch.allclose(flat_weights(accum.model) - start, moved, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(flat_weights(half.model) - start, moved, rtol=1e-2, atol=1e-5)  # the test can fail


def _one_sgd_update(tmp_path: Path, clip: float, scale: float = 0.0) -> torch.Tensor:
    """The weight change of one plain SGD step (lr 1, no momentum): minus the (clipped) gradient."""
    run = make_run(
        tmp_path, "OPTIM.BASE_LR", "1.0", "OPTIM.MOMENTUM", "0.0", "OPTIM.NESTEROV", "False",
        "OPTIM.WEIGHT_DECAY", "0.0", "TRAIN.CLIP_GRAD_NORM", str(clip), "TRAIN.BATCH_SIZE", "16",
    )  # fmt: skip
    if scale:  # as fp16 would: gradients arrive scaled and must be unscaled before clipping
        run.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    before = flat_weights(run.model)
    trainer.train_step(run, micro_batches(run, 1), sums_for(run))
    return flat_weights(run.model) - before


def test_clipping_bounds_the_global_gradient_norm_after_unscaling(tmp_path):
    free = _one_sgd_update(tmp_path, clip=0.0)
    max_norm = float(free.norm()) / 4
    clipped = _one_sgd_update(tmp_path, clip=max_norm)
    assert clipped.norm() == pytest.approx(max_norm, rel=1e-4)  # the global norm over all parameters
    assert torch.allclose(clipped, free * (max_norm / free.norm()), atol=1e-7)  # same direction
    scaled = _one_sgd_update(tmp_path, clip=max_norm, scale=2.0**10)
    assert torch.allclose(scaled, clipped, atol=1e-7)
    loose = _one_sgd_update(tmp_path, clip=float(free.norm()) * 2)
    assert torch.allclose(loose, free, atol=1e-7)  # a bound above the norm changes nothing


def _closed_form_ema(w0: torch.Tensor, history: list[torch.Tensor], decays: list[float]) -> torch.Tensor:
    """prod(d) w0 + sum_i (1 - d_i) prod_{j>i} d_j w_i."""
    total = math.prod(decays) * w0
    for i, (w, d) in enumerate(zip(history, decays)):
        total = total + (1 - d) * math.prod(decays[i + 1 :]) * w
    return total


@pytest.mark.parametrize("warmup, period", [(True, 1), (False, 1), (True, 2)])
def test_ema_equals_the_closed_form_average_of_the_weight_history(tmp_path, warmup, period):
    decay = 0.8
    run = make_run(
        tmp_path, "OPTIM.EMA_DECAY", str(decay), "OPTIM.EMA_WARMUP", str(warmup), "OPTIM.EMA_PERIOD", str(period),
        "TRAIN.BATCH_SIZE", "16",
    )  # fmt: skip
    w0, history = flat_weights(run.model), []
    for step, batch in enumerate(micro_batches(run, 6)):
        trainer.train_step(run, [batch], sums_for(run))
        run.state.step_in_epoch = step + 1  # as train_epoch counts steps
        if (step + 1) % period == 0:
            history.append(flat_weights(run.model))
    decays = [min(decay, (1 + n) / (10 + n)) if warmup else decay for n in range(len(history))]
    expected = _closed_form_ema(w0, history, decays)
    assert run.ema.updates == 6 // period
    assert torch.allclose(flat_weights(run.ema.module), expected, atol=1e-6)
    assert not torch.allclose(flat_weights(run.model), expected, atol=1e-4)  # the EMA lags the weights


def test_ema_state_round_trips_and_skips_integer_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ema = ModelEMA(model, 0.5, warmup=False)
    model[1].num_batches_tracked += 7
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    assert int(ema.module[1].num_batches_tracked) == 7  # copied, not averaged
    clone = ModelEMA(model, 0.5)
    clone.load_state_dict(ema.state_dict())
    assert clone.updates == 1 and torch.equal(clone.module[0].weight, ema.module[0].weight)


def _hand_cross_entropy(logits: torch.Tensor, soft: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-sum_k t'_k log p_k with t' = (1 - eps) t + eps / K, averaged over the batch."""
    log_p = logits.double().log_softmax(1)
    smoothed = soft.double() * (1 - smoothing) + smoothing / logits.size(1)
    return -(smoothed * log_p).sum(1).mean()


def test_label_smoothing_changes_the_loss_exactly_as_its_formula_says(tmp_path):
    torch.manual_seed(1)
    logits, targets = torch.randn(12, 10) * 3, torch.randint(0, 10, (12,))
    one_hot = nn.functional.one_hot(targets, 10)
    for eps in (0.0, 0.1, 0.3):
        criterion = make_run(tmp_path, "TRAIN.LABEL_SMOOTHING", str(eps)).criterion
        expected = _hand_cross_entropy(logits, one_hot, eps)
        # Also: (1 - eps) x the plain cross-entropy + eps x the mean over classes of -log p.
        log_p = logits.double().log_softmax(1)
        other_form = (1 - eps) * -log_p.gather(1, targets[:, None]).mean() + eps * -log_p.mean()
        assert float(criterion(logits, targets)) == pytest.approx(float(expected), rel=1e-6)
        assert float(expected) == pytest.approx(float(other_form), rel=1e-9)
    assert float(_hand_cross_entropy(logits, one_hot, 0.1)) != pytest.approx(
        float(_hand_cross_entropy(logits, one_hot, 0.0))
    )


def _mixer(*opts: str):
    # A run's mixer is built once build_run has resolved the class count (MODEL.NUM_CLASSES 0: the data's)
    return build_batch_mixer(load_cfg(None, ["MODEL.NUM_CLASSES", "10", *opts]))


def test_mixup_gives_soft_targets_summing_to_one_that_match_the_mixed_images():
    torch.manual_seed(2)
    images, targets = torch.randn(8, 3, 16, 16), torch.arange(8)  # neighbours differ in class
    mixed, soft = _mixer("DATA.MIXUP_ALPHA", "0.4")(images, targets)
    assert soft.shape == (8, 10) and torch.allclose(soft.sum(1), torch.ones(8)) and (soft >= 0).all()
    lam = soft[0, 0]  # one lambda per batch; the batch is mixed with itself rolled by one
    assert 0 < lam < 1
    expected_soft = lam * nn.functional.one_hot(targets, 10) + (1 - lam) * nn.functional.one_hot(targets.roll(1), 10)
    assert torch.allclose(soft, expected_soft.float(), atol=1e-6)
    assert torch.allclose(mixed, lam * images + (1 - lam) * images.roll(1, 0), atol=1e-5)


def test_cutmix_label_weights_are_the_pasted_area_fractions():
    torch.manual_seed(3)
    images, targets = torch.randn(8, 3, 16, 16), torch.arange(8)
    mixed, soft = _mixer("DATA.CUTMIX_ALPHA", "1.0")(images, targets)
    assert torch.allclose(soft.sum(1), torch.ones(8))
    pasted = (mixed == images.roll(1, 0)).all(1) & (mixed != images).any(1)  # pixels from the neighbour
    for i in range(8):
        assert float(soft[i, targets[i - 1]]) == pytest.approx(float(pasted[i].float().mean()), abs=1e-6)
        assert float(soft[i, targets[i]]) == pytest.approx(1 - float(pasted[i].float().mean()), abs=1e-6)


def test_mix_prob_zero_and_switch_prob_pick_as_configured():
    images, targets = torch.randn(8, 3, 16, 16), torch.arange(8)
    plain, soft = _mixer("DATA.MIXUP_ALPHA", "0.4", "DATA.MIX_PROB", "0.0")(images, targets)
    assert torch.equal(plain, images) and torch.equal(soft, nn.functional.one_hot(targets, 10).float())
    # MIX_SWITCH_PROB 1.0: always cutmix, whose images keep unmixed pixel values (mixup's would not).
    mixed, _ = _mixer("DATA.MIXUP_ALPHA", "0.4", "DATA.CUTMIX_ALPHA", "1.0", "DATA.MIX_SWITCH_PROB", "1.0")(
        images, targets
    )
    assert ((mixed == images) | (mixed == images.roll(1, 0))).all()
    assert _mixer() is None


def test_the_training_loss_accepts_mixed_soft_targets(tmp_path):
    eps = 0.1
    run = make_run(tmp_path, "DATA.MIXUP_ALPHA", "0.4", "DATA.CUTMIX_ALPHA", "1.0", "TRAIN.LABEL_SMOOTHING", str(eps))
    torch.manual_seed(4)
    mixed, soft = run.mixer(torch.randn(6, 3, 16, 16), torch.arange(6))
    with torch.no_grad():
        logits = run.model(mixed)
    assert float(run.criterion(logits, soft)) == pytest.approx(float(_hand_cross_entropy(logits, soft, eps)), rel=1e-5)
    loss = trainer.train_step(run, micro_batches(run, 1), sums_for(run))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
def test_auto_augment_and_random_erasing_are_in_the_train_transform(policy):
    from torchvision.transforms import v2

    from distribuuuu.data import load_image
    from distribuuuu.training.preprocessing import build_train_transform

    cfg = load_cfg(None, ["DATA.AUTO_AUGMENT", policy, "DATA.RANDOM_ERASING", "1.0", "TRAIN.IM_SIZE", "32"])
    wanted = {"randaugment": v2.RandAugment, "trivialaugment": v2.TrivialAugmentWide, "autoaugment": v2.AutoAugment}
    assert wanted[policy] in [type(t) for t in build_train_transform(cfg).transforms]
    image = load_image(str(next((DIGITS / "train" / "3").glob("*.png"))), "auto")
    torch.manual_seed(0)
    pixels = build_train_transform(cfg, normalize=False)(image)  # what the workers hand over
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 32, 32)
    torch.manual_seed(0)
    normalised = build_train_transform(cfg)(image)
    # Every image is erased (p=1): a rectangle of the mean colour, about 0 once normalised.
    erased = (normalised.abs() < 0.01).all(dim=0)
    assert erased.sum() >= 0.02 * 32 * 32, erased.sum()


def test_random_erasing_makes_its_fill_once_and_erases_as_torchvision_does(monkeypatch):
    # torchvision builds the fill value on the CPU for each erased sample: on a GPU, a pageable copy
    # per sample that waits for the training stream. Ours is made once (per device).
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    from distribuuuu.training.preprocessing import build_train_transform

    cfg = load_cfg(None, ["DATA.RANDOM_ERASING", "1.0", "TRAIN.IM_SIZE", "32"])
    [erasing] = [t for t in build_train_transform(cfg, normalize=False).transforms if isinstance(t, v2.RandomErasing)]
    reference = v2.RandomErasing(p=1.0, value=erasing.value)  # torchvision's own, same settings
    generator = torch.Generator().manual_seed(0)
    images = [
        tv_tensors.Image(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=generator)) for _ in range(4)
    ]
    expected = []
    for seed, image in enumerate(images):
        torch.manual_seed(seed)
        expected.append(reference(image))
    fills, transform = [], v2.RandomErasing.transform

    def recording(self, inpt, params):
        fills.append(params["v"])
        return transform(self, inpt, params)

    monkeypatch.setattr(v2.RandomErasing, "transform", recording)
    for seed, (image, want) in enumerate(zip(images, expected)):
        torch.manual_seed(seed)
        assert torch.equal(erasing(image), want)
    assert len(fills) == 4 and all(fill is fills[0] for fill in fills)


# ------------------------------------------------------------------------------------------------
# Optimizer groups, LARS, AdamW, linear scaling, LR schedule
# ------------------------------------------------------------------------------------------------
def _decay_of(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}


def test_no_weight_decay_on_norm_weights_and_biases_unless_asked():
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    norm_or_bias = {
        id(p)
        for m in model.modules()
        for name, p in m.named_parameters(recurse=False)
        if isinstance(m, nn.BatchNorm2d) or name == "bias"
    }
    assert len(norm_or_bias) == 2 * 20 + 1  # 20 BatchNorms (weight, bias) and the fc bias
    o = get_cfg_defaults().OPTIM
    decay = _decay_of(build_optimizer(model, o))
    assert len(decay) == len(list(model.parameters()))
    for p in model.parameters():
        assert decay[id(p)] == (0.0 if id(p) in norm_or_bias else o.WEIGHT_DECAY)
    o.WEIGHT_DECAY_NORM_BIAS = True
    assert set(_decay_of(build_optimizer(model, o)).values()) == {o.WEIGHT_DECAY}


def test_one_lars_step_matches_a_hand_computation():
    torch.manual_seed(5)
    model = nn.Linear(3, 2)
    o = get_cfg_defaults().OPTIM
    o.OPTIMIZER, o.BASE_LR, o.MOMENTUM, o.WEIGHT_DECAY, o.LARS_TRUST = "lars", 0.1, 0.9, 0.01, 0.02
    optimizer = build_optimizer(model, o)
    assert isinstance(optimizer, LARS)
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    grads = [(torch.randn(2, 3), torch.randn(2)) for _ in range(2)]
    w_buf = b_buf = None
    for gw, gb in grads:
        model.weight.grad, model.bias.grad = gw.clone(), gb.clone()
        optimizer.step()
        # Weight: decay, then the layer-wise trust ratio eta ||w|| / ||g + wd w||, then momentum.
        g = gw + 0.01 * w
        local_lr = 0.02 * w.norm() / g.norm()
        w_buf = local_lr * g if w_buf is None else 0.9 * w_buf + local_lr * g
        w = w - 0.1 * w_buf
        # Bias (1-D): no decay, no adaptation, plain momentum SGD.
        b_buf = gb if b_buf is None else 0.9 * b_buf + gb
        b = b - 0.1 * b_buf
        assert torch.allclose(model.weight, w, atol=1e-7) and torch.allclose(model.bias, b, atol=1e-7)


def test_adamw_takes_the_fused_kernel_and_steps_as_the_per_tensor_loop():
    o = get_cfg_defaults().OPTIM
    o.OPTIMIZER, o.WEIGHT_DECAY = "adamw", 0.05
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    fused, loop_model = build_optimizer(model, o), copy.deepcopy(model)
    loop = torch.optim.AdamW(optimizer_groups(loop_model, o), lr=o.BASE_LR, betas=tuple(o.BETAS), foreach=False)
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    x = torch.randn(4, 8)
    for m, opt in ((model, fused), (loop_model, loop)):
        m(x).square().mean().backward()
        opt.step()
    # One step from the same weights and gradients: the same fp32 update, a few units in the last
    # place apart at most (after it, Adam's g / sqrt(v) would magnify them on near-zero gradients).
    for a, b in zip(model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b)
    # SGD keeps its loop unless fp16 asks (fused SGD has no DTensor rule); ZeRO-1 shards a plain optimizer.
    o.OPTIMIZER = "sgd"
    assert not build_optimizer(model, o).defaults.get("fused")


def test_adamw_builds_with_the_configured_betas_and_decay_groups():
    o = get_cfg_defaults().OPTIM
    o.OPTIMIZER, o.BETAS, o.WEIGHT_DECAY = "adamw", [0.8, 0.95], 0.05
    optimizer = build_optimizer(nn.Linear(3, 2), o)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [(g["betas"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ((0.8, 0.95), 0.05),
        ((0.8, 0.95), 0.0),
    ]


def test_linear_scaling_rule():
    o = get_cfg_defaults().OPTIM
    o.BASE_LR, o.REFERENCE_BATCH = 0.1, 256
    assert scaled_base_lr(o, 1024) == pytest.approx(0.4)
    assert scaled_base_lr(o, 64) == pytest.approx(0.025)
    o.REFERENCE_BATCH = 0
    assert scaled_base_lr(o, 1024) == 0.1


def _schedule(policy: str):
    o = get_cfg_defaults().OPTIM
    o.LR_POLICY, o.BASE_LR, o.MIN_LR, o.MAX_EPOCH = policy, 0.4, 0.01, 10
    o.WARMUP_EPOCHS, o.WARMUP_FACTOR, o.STEPS, o.LR_MULT = 2.0, 0.1, [3, 6], 0.1
    return o


@pytest.mark.parametrize(
    "policy, step, expected",
    [
        # 50 steps an epoch; warmup multiplies by 0.1 (1 - a) + a, a = epoch / 2, for epochs < 2.
        ("cos", 0, 0.4 * 0.1),
        ("cos", 50, (0.01 + 0.39 * 0.5 * (1 + math.cos(math.pi * 0.1))) * 0.55),
        ("cos", 100, 0.01 + 0.39 * 0.5 * (1 + math.cos(math.pi * 0.2))),
        ("cos", 250, 0.01 + 0.39 * 0.5),
        ("cos", 500, 0.01),
        ("lin", 25, (0.4 - 0.39 * 0.05) * 0.325),
        ("lin", 250, 0.4 - 0.39 * 0.5),
        ("lin", 400, 0.4 - 0.39 * 0.8),
        ("steps", 25, 0.4 * 0.325),
        ("steps", 149, 0.4),
        ("steps", 150, 0.04),
        ("steps", 299, 0.04),
        ("steps", 300, 0.004),
    ],
)
def test_lr_at_matches_its_formula(policy, step, expected):
    assert lr_at(step, 50, _schedule(policy)) == pytest.approx(expected, rel=1e-12)


def test_lr_changes_within_an_epoch_and_base_lr_overrides():
    o = _schedule("cos")
    assert lr_at(10, 50, o) < lr_at(11, 50, o)  # warmup, step by step
    assert lr_at(260, 50, o) < lr_at(259, 50, o)  # cosine, step by step
    assert lr_at(250, 50, o, base_lr=0.8) == pytest.approx(0.01 + 0.79 * 0.5)
