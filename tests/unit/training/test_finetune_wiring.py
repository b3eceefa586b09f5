"""The fine-tuning keys wired through a real build_run and the real training loop.

Each test builds a Run from a config, as train_model does, runs the trainer's own code, and
compares with an independent computation: the closed-form LR of each layer, a BCE loss and a
LAMB update written out by hand, the names that freezing must leave untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import dataset_targets
from distribuuuu.data.samplers import WeightedDistributedSampler
from distribuuuu.logger import setup_logging
from distribuuuu.models import register_model
from distribuuuu.records.meters import MetricSums
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.trainer import train_epoch, train_step
from distribuuuu.training.optim import lr_at, set_lr
from distribuuuu.training.resume import load_weights
from distribuuuu.training.rng import seed_everything
from distribuuuu.training.run import build_run
from distribuuuu.training.session import Session

NUM_LAYERS = 3


@register_model("wiring_vit")
def _tiny_vit(num_classes: int = 10, pretrained: bool = False) -> nn.Module:
    # torchvision ViT's parameter names at a test size: 16 x 16 images, 4 patches.
    return VisionTransformer(
        image_size=16,
        patch_size=8,
        num_layers=NUM_LAYERS,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        num_classes=num_classes,
    )


class _TinyNet(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


register_model("wiring_tiny")(lambda num_classes=10, pretrained=False: _TinyNet(num_classes))


def _run(*opts: str):
    cfg = load_cfg(
        opts=[
            "MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", "96", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
            "TRAIN.BATCH_SIZE", "8", "TRAIN.PRINT_FREQ", "4", "OPTIM.MAX_EPOCH", "2", *opts,
        ]
    )  # fmt: skip
    seed_everything(cfg.RNG_SEED)
    return build_run(cfg, DistEnv())


def _vit_layer(name: str) -> int:
    """torchvision ViT's layer of a parameter, written out: embeddings 0, block i -> i + 1, the rest N + 1."""
    if name in ("class_token", "encoder.pos_embedding") or name.startswith("conv_proj."):
        return 0
    if name.startswith("encoder.layers.encoder_layer_"):
        return int(name.split(".")[2].rsplit("_", 1)[1]) + 1
    return NUM_LAYERS + 1


def test_layer_decay_and_head_multiplier_give_each_parameter_its_closed_form_lr_in_the_real_loop():
    decay, head_mult = 0.5, 4.0
    run = _run(
        "MODEL.ARCH", "wiring_vit", "OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.01", "OPTIM.WARMUP_EPOCHS", "1.0",
        "OPTIM.LAYER_DECAY", str(decay), "OPTIM.HEAD_LR_MULT", str(head_mult),
    )  # fmt: skip
    names = {id(p): n for n, p in run.model.named_parameters()}
    seen: list[dict[str, float]] = []
    run.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]})
    )
    for epoch in range(2):
        train_epoch(run, Session(run.cfg, env=run.env), epoch)
        run.state = run.at_step(epoch + 1, 0)  # as train_epochs starts the next epoch
    assert len(seen) == 2 * run.steps_per_epoch == 24
    for step, lrs in enumerate(seen):
        lr = lr_at(step, run.steps_per_epoch, run.cfg.OPTIM)
        assert set(lrs) == set(names.values())
        for name, group_lr in lrs.items():
            expected = (
                lr * decay ** (NUM_LAYERS + 1 - _vit_layer(name)) * (head_mult if name.startswith("heads.") else 1)
            )
            assert group_lr == pytest.approx(expected, rel=1e-12), (step, name)


def test_the_logged_lr_is_the_schedules_not_the_first_groups_scaled_lr(caplog):
    run = _run("MODEL.ARCH", "wiring_vit", "OPTIM.LAYER_DECAY", "0.5", "OPTIM.WARMUP_EPOCHS", "0.0")
    with caplog.at_level("INFO", logger="distribuuuu.trainer"):
        train_epoch(run, Session(run.cfg, env=run.env), 0)
    logged = [float(line.split(" lr ")[1].split()[0]) for line in caplog.messages if " lr " in line]
    expected = [lr_at(s - 1, run.steps_per_epoch, run.cfg.OPTIM) for s in (4, 8, 12)]
    assert logged == pytest.approx(expected, rel=1e-4)  # printed with 5 significant digits
    assert run.optimizer.param_groups[0]["lr"] < 0.2 * logged[-1]  # the stem's LR is far below it


def test_frozen_parameters_are_left_out_of_the_optimizer_and_stay_bit_identical():
    run = _run("MODEL.ARCH", "resnet18", "MODEL.FREEZE", "['conv1.*', 'bn1.*', 'layer1.0.*']")
    frozen = {
        n: p.detach().clone() for n, p in run.model.named_parameters() if n.startswith(("conv1.", "bn1.", "layer1.0."))
    }
    assert len(frozen) == 3 + 6  # conv1.weight, bn1.weight/bias; layer1.0: two convs, two BNs
    in_optimizer = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    params = dict(run.model.named_parameters())
    assert not any(id(params[n]) in in_optimizer for n in frozen)
    assert len(in_optimizer) == len(params) - len(frozen)
    before = {n: p.detach().clone() for n, p in params.items()}
    train_epoch(run, Session(run.cfg, env=run.env), 0)
    assert all(torch.equal(params[n], value) for n, value in frozen.items())
    assert not torch.equal(params["fc.weight"], before["fc.weight"])  # the rest did train


def test_a_freeze_pattern_that_matches_nothing_is_one_config_error_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"^MODEL.FREEZE: freeze patterns match no parameter of ResNet: \['conv9.\*'\]"
    ):
        _run("MODEL.ARCH", "resnet18", "MODEL.FREEZE", "['conv9.*']")


def _hand_bce(logits: torch.Tensor, targets: torch.Tensor, smoothing: float, threshold: float) -> torch.Tensor:
    """timm's BinaryCrossEntropy written out: smoothed one-hot, thresholded, mean of -[y log s + (1-y) log(1-s)]."""
    num_classes = logits.size(1)
    soft = torch.full_like(logits, smoothing / num_classes)
    soft[torch.arange(len(targets)), targets] = 1 - smoothing + smoothing / num_classes
    y = (soft > threshold).float()
    s = torch.sigmoid(logits.double())
    return -(y * torch.log(s) + (1 - y) * torch.log(1 - s)).mean()


def _hand_lamb(p: torch.Tensor, g: torch.Tensor, lr: float, wd: float, eps: float = 1e-6) -> torch.Tensor:
    """LAMB's first step (You et al., 2019): m^ = g, v^ = g^2, r = m^ / (sqrt(v^) + eps) + wd x p,
    scaled by ||p|| / ||r|| for matrices and conv kernels."""
    update = g / (g.abs() + eps) + wd * p
    if p.ndim > 1:
        update = update * (p.norm() / update.norm())
    return p - lr * update


def test_one_bce_step_with_lamb_through_build_run_equals_the_hand_computation():
    run = _run(
        "MODEL.ARCH", "wiring_tiny", "TRAIN.LOSS", "bce", "TRAIN.LABEL_SMOOTHING", "0.1",
        "TRAIN.BCE_TARGET_THRESHOLD", "0.05", "OPTIM.OPTIMIZER", "lamb", "OPTIM.WEIGHT_DECAY", "0.02",
    )  # fmt: skip
    reference = copy.deepcopy(run.model)
    images, targets, skipped = next(iter(run.train.loader))
    lr = 0.003
    set_lr(run.optimizer, lr)
    loss = train_step(run, [(images, targets, skipped)], MetricSums(torch.device("cpu"), run.cfg.TRAIN.TOPK))

    expected_loss = _hand_bce(reference(images), targets, 0.1, 0.05)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    expected_loss.backward()
    for (name, p), (_, p_ref) in zip(run.model.named_parameters(), reference.named_parameters()):
        wd = 0.02 if p.ndim > 1 else 0.0  # biases get no weight decay
        expected = _hand_lamb(p_ref.detach().double(), p_ref.grad.double(), lr, wd)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-7, msg=name)


def test_balanced_class_weights_reach_the_criterion_as_inverse_frequencies():
    run = _run("MODEL.ARCH", "wiring_tiny", "TRAIN.CLASS_WEIGHTS", "balanced")
    targets = dataset_targets(run.train.dataset)
    counts = torch.bincount(targets, minlength=10).double()
    expected = len(targets) / (10 * counts)  # scikit-learn's "balanced", written out
    torch.testing.assert_close(run.criterion.weight.double(), expected, rtol=1e-6, atol=0)


def test_the_weighted_sampler_draws_each_sample_in_inverse_proportion_to_its_class_size():
    run = _run("MODEL.ARCH", "wiring_tiny", "TRAIN.SAMPLER", "weighted")
    targets = dataset_targets(run.train.dataset)
    counts = torch.bincount(targets, minlength=10).double()
    expected = (len(targets) / (10 * counts))[targets]
    assert isinstance(run.train.sampler, WeightedDistributedSampler)
    torch.testing.assert_close(run.train.sampler.weights, expected, rtol=1e-6, atol=0)
    keys = list(run.train.sampler)
    assert len(keys) == len(targets) and len({index for _, index in keys}) < len(targets)  # with replacement


@pytest.mark.usefixtures("plain_logging")
@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_says_which_tensors_the_weights_miss_and_a_new_head_once(tmp_path, capsys, rank):
    def net(classes: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, classes))

    path = str(tmp_path / "pretrained.pth.tar")
    state = net(10).state_dict()
    del state["0.bias"]  # a tensor the file lacks
    ckpt.save_checkpoint({"model": state}, path)
    setup_logging(None, rank)  # as every rank of a run sets it up: rank 0 to stdout, the others' warnings to stderr
    load_weights(net(5), path, strict=False)  # fine-tuning: a new 5-class head, the 10-class one skipped
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    said = [line for line in lines if "missing" in line]
    assert len(said) == (1 if rank == 0 else 0), out
    if rank == 0:
        assert "['0.bias']" in said[0] and out.err == "", "rank 0 says it, on stdout, without the new head"
        head = [line for line in lines if "2.weight" in line]  # the new head's tensors: said once, as skipped
        assert len(head) == 1 and "skipped 2 tensors of another shape" in head[0], lines
