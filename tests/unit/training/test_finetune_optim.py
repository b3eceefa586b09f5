"""Fine-tuning and recipe optimizer pieces: per-group LR scales, head multiplier, layer-wise LR decay,
no_weight_decay(), freezing, LARS adaptation by parameter, LAMB.

Each test compares against an independent computation: a layer id written out from the parameter
name, a closed-form LR, or an update step written out from the published formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchvision.models.convnext import CNBlockConfig, ConvNeXt
from torchvision.models.vision_transformer import VisionTransformer

from distribuuuu.config import get_cfg_defaults
from distribuuuu.training.optim import LAMB, LARS, build_optimizer, freeze, layer_ids, lr_at, param_groups, set_lr


def _lr_of(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}


def _schedule():
    o = get_cfg_defaults().OPTIM
    o.BASE_LR, o.MAX_EPOCH, o.WARMUP_EPOCHS, o.LR_POLICY = 0.4, 4, 1.0, "cos"
    return o


STEPS = (0, 3, 10, 25, 39)  # warmup, its end, cosine decay; 10 steps per epoch


def test_set_lr_keeps_each_groups_lr_scale_at_every_step():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    groups = [{"params": [params[0]]}, *({"params": [p], "lr_scale": s} for p, s in zip(params[1:], (1.0, 0.1, 2.0)))]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    o = _schedule()
    for step in STEPS:
        lr = lr_at(step, 10, o)
        set_lr(optimizer, lr)
        assert [g["lr"] for g in optimizer.param_groups] == [lr, lr, lr * 0.1, lr * 2.0]


def test_default_groups_are_the_decay_and_no_decay_pair_with_unit_scale():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    groups = param_groups(model, 0.05, decay_norm_bias=False)
    assert [(g["name"], g["weight_decay"], g["lr_scale"], len(g["params"])) for g in groups] == [
        ("decay", 0.05, 1.0, 2),
        ("no_decay", 0.0, 1.0, 4),
    ]


def _tiny_vit(num_layers: int = 3) -> VisionTransformer:
    # vit_b_16's class and parameter names at a test-sized width and depth.
    return VisionTransformer(
        image_size=32, patch_size=16, num_layers=num_layers, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=10
    )


def _vit_layer(name: str, num_layers: int) -> int:
    """torchvision ViT's layer ids written out by hand: embeddings 0, block i -> i + 1, the rest last."""
    if name in ("class_token", "encoder.pos_embedding") or name.startswith("conv_proj."):
        return 0
    if name.startswith("encoder.layers.encoder_layer_"):
        return int(name.split(".")[2].rsplit("_", 1)[1]) + 1
    assert name.startswith(("encoder.ln.", "heads.")), name
    return num_layers + 1


@pytest.mark.parametrize("head_lr_mult", [1.0, 10.0])
def test_layer_decay_lr_of_every_vit_parameter_is_its_closed_form_at_every_step(head_lr_mult):
    model, decay, o = _tiny_vit(3), 0.65, _schedule()
    optimizer = torch.optim.AdamW(param_groups(model, 0.05, False, head_lr_mult=head_lr_mult, layer_decay=decay))
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names) == sorted(_lr_of(optimizer))  # every parameter, once
    for step in STEPS:
        lr = lr_at(step, 10, o)
        set_lr(optimizer, lr)
        for pid, got in _lr_of(optimizer).items():
            name = names[pid]
            head = head_lr_mult if name.startswith("heads.") else 1.0
            assert got == pytest.approx(lr * decay ** (3 + 1 - _vit_layer(name, 3)) * head, rel=1e-12), name


def test_convnext_downsampling_goes_with_the_next_stage_and_the_stem_is_layer_zero():
    blocks = [CNBlockConfig(8, 16, 2), CNBlockConfig(16, None, 1)]  # features.1 (2 blocks), .2 down, .3 (1)
    ids, num_layers = layer_ids(ConvNeXt(blocks, num_classes=5))
    assert num_layers == 3
    expected = {"features.0.": 0, "features.1.0.": 1, "features.1.1.": 2, "features.2.": 3, "features.3.0.": 3}
    for name, layer in ids.items():
        prefix = next((p for p in expected if name.startswith(p)), "classifier.")
        assert layer == expected.get(prefix, num_layers + 1), name


def test_timm_vit_names_get_the_same_layer_ids():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=3)
    ids, num_layers = layer_ids(model)
    assert num_layers == 2
    for name, layer in ids.items():
        if name.startswith("blocks."):
            assert layer == int(name.split(".")[1]) + 1
        else:
            assert layer == (0 if name in ("cls_token", "pos_embed") or name.startswith("patch_embed.") else 3)


def test_layer_decay_on_a_model_without_blocks_is_an_error():
    with pytest.raises(ValueError, match="no blocks found in Sequential"):
        param_groups(nn.Sequential(nn.Linear(2, 2)), 0.0, False, layer_decay=0.7)


def test_head_multiplier_finds_the_classifier_by_name_or_last_linear():
    import torchvision

    for model, head in [
        (torchvision.models.resnet18(num_classes=4), {"fc.weight", "fc.bias"}),
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)), {"2.weight", "2.bias"}),
    ]:
        optimizer = torch.optim.SGD(param_groups(model, 0.0, False, head_lr_mult=5.0), lr=1.0)
        set_lr(optimizer, 0.2)
        lrs = _lr_of(optimizer)
        for name, p in model.named_parameters():
            assert lrs[id(p)] == pytest.approx(1.0 if name in head else 0.2), name


class _WithPositionEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))  # 3-D: the ndim rule alone would decay it
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}


def test_model_no_weight_decay_names_and_patterns_are_not_decayed():
    model = _WithPositionEmbedding()
    decay = {id(p): g["weight_decay"] for g in param_groups(model, 0.1, False) for p in g["params"]}
    undecayed = {"pos_embed", "cls_token", "proj.bias", "head.bias"}
    assert {n for n, p in model.named_parameters() if decay[id(p)] == 0.0} == undecayed
    groups = param_groups(model, 0.1, True, no_weight_decay_names=("proj.*",))
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    undecayed = {"pos_embed", "cls_token", "proj.weight", "proj.bias"}
    assert {n for n, p in model.named_parameters() if decay[id(p)] == 0.0} == undecayed


def test_frozen_parameters_match_the_patterns_and_leave_the_optimizer():
    model = _tiny_vit(2)
    frozen = freeze(model, ["conv_proj.*", "encoder.layers.encoder_layer_0.*"])
    assert frozen and all(n.startswith(("conv_proj.", "encoder.layers.encoder_layer_0.")) for n in frozen)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(frozen)
    in_optimizer = set(_lr_of(torch.optim.SGD(param_groups(model, 0.0, False, layer_decay=0.5), lr=1.0)))
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    with pytest.raises(ValueError, match=r"match no parameter of VisionTransformer: \['stem\.\*'\]"):
        freeze(model, ["stem.*"])


def test_lars_does_not_adapt_biases_even_when_they_are_decayed():
    torch.manual_seed(5)
    model = nn.Linear(3, 2)
    o = get_cfg_defaults().OPTIM
    o.OPTIMIZER, o.BASE_LR, o.MOMENTUM, o.WEIGHT_DECAY, o.LARS_TRUST = "lars", 0.1, 0.9, 0.01, 0.02
    o.WEIGHT_DECAY_NORM_BIAS = True  # one group holding weight and bias
    optimizer = build_optimizer(model, o)
    assert isinstance(optimizer, LARS) and len(optimizer.param_groups) == 1
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    gw, gb = torch.randn(2, 3), torch.randn(2)
    model.weight.grad, model.bias.grad = gw.clone(), gb.clone()
    optimizer.step()
    g = gw + 0.01 * w  # weight: decayed and scaled by eta ||w|| / ||g + wd w||
    assert torch.allclose(model.weight, w - 0.1 * 0.02 * w.norm() / g.norm() * g, atol=1e-7)
    assert torch.allclose(model.bias, b - 0.1 * (gb + 0.01 * b), atol=1e-7)  # bias: decayed, not adapted


def _lamb_reference(w, grads, lr, beta1, beta2, eps, wd, adapt):
    """LAMB (You et al., 2019, Algorithm 2) written out: Adam moments with bias correction,
    decoupled decay, then the trust ratio ||w|| / ||update||."""
    m = v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + wd * w
        ratio = w.norm() / r.norm() if adapt else 1.0
        w = w - lr * ratio * r
    return w


def test_lamb_steps_match_the_written_out_formulas():
    torch.manual_seed(7)
    model = nn.Linear(4, 3)
    o = get_cfg_defaults().OPTIM
    o.OPTIMIZER, o.BASE_LR, o.BETAS, o.WEIGHT_DECAY = "lamb", 0.01, [0.9, 0.99], 0.05
    optimizer = build_optimizer(model, o)
    assert isinstance(optimizer, LAMB)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    grads = [(torch.randn(3, 4), torch.randn(3)) for _ in range(3)]
    for gw, gb in grads:
        model.weight.grad, model.bias.grad = gw.clone(), gb.clone()
        optimizer.step()
    w = _lamb_reference(w0, [g for g, _ in grads], 0.01, 0.9, 0.99, 1e-6, 0.05, adapt=True)
    b = _lamb_reference(b0, [g for _, g in grads], 0.01, 0.9, 0.99, 1e-6, 0.0, adapt=False)  # 1-D: no decay
    assert torch.allclose(model.weight, w, atol=1e-6) and torch.allclose(model.bias, b, atol=1e-6)
    assert not math.isclose(model.weight[0, 0].item(), w0[0, 0].item())  # it moved


def test_lamb_matches_timms_on_adapted_parameters():
    timm_optim = pytest.importorskip("timm.optim")
    torch.manual_seed(3)
    ours, theirs = nn.Linear(5, 4, bias=False), nn.Linear(5, 4, bias=False)
    theirs.load_state_dict(ours.state_dict())
    a = LAMB(ours.parameters(), lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)
    # timm's defaults differ on two points: global gradient clipping at 1.0, and no adaptation
    # without weight decay; with clipping off and decay on, the update is the same.
    b = timm_optim.Lamb(
        theirs.parameters(), lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1, max_grad_norm=None
    )
    for _ in range(3):
        grad = torch.randn(4, 5)
        ours.weight.grad, theirs.weight.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.allclose(ours.weight, theirs.weight, atol=1e-6)
