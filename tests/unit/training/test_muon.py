"""OPTIM.OPTIMIZER muon: torch.optim.Muon on the hidden 2-D weight matrices, AdamW on the rest.

Checked: which parameters each half gets (against the models' layer names, written out here), one
step against torch's Muon and AdamW stepped separately (torch's documented two-optimizer use), the
first step against Muon's closed form (the gradient orthogonalised: its singular vectors, singular
values in Newton-Schulz's band), the state through a file and through DCP. (FSDP2, a launch: tests/integration/test_muon_runs.py.)
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torchvision
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.training.muon import MuonWithAdamW
from distribuuuu.training.optim import build_optimizer, set_lr

LR, WD = 0.01, 0.05


def _optim_cfg(*opts: str):
    return load_cfg(
        None, ["OPTIM.OPTIMIZER", "muon", "OPTIM.BASE_LR", str(LR), "OPTIM.WEIGHT_DECAY", str(WD), *opts]
    ).OPTIM


def _vit() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
    )
    nn.init.normal_(model.heads.head.weight, std=0.5)  # torchvision zeroes it: no gradient would reach the layers
    return model


def _muon_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}


def test_hidden_weight_matrices_go_to_muon_and_the_rest_to_adamw():
    model = _vit()
    optimizer = build_optimizer(model, _optim_cfg())
    assert isinstance(optimizer, MuonWithAdamW)
    # torchvision's encoder layers: attention in/out projections and the two MLP matrices; not the
    # head (heads.head), the patch embedding (4-D conv), the class token or position embedding (3-D).
    hidden = r"encoder\.layers\.encoder_layer_\d\.(self_attention\.(in_proj_weight|out_proj\.weight)|mlp\.[03]\.weight)"
    expected = {n for n, _ in model.named_parameters() if re.fullmatch(hidden, n)}
    assert len(expected) == 8 and _muon_names(model, optimizer) == expected
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(everything) == len(list(model.parameters())) == len({id(p) for p in everything})
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert all(decay[id(p)] == (WD if p.ndim > 1 else 0.0) for p in model.parameters())  # the usual decay groups


def test_a_timm_vits_embeddings_and_a_resnets_kernels_stay_with_adamw(caplog):
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, num_classes=10)
    names = _muon_names(vit, build_optimizer(vit, _optim_cfg()))
    assert names == {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    }
    resnet = torchvision.models.resnet18(num_classes=10)
    with caplog.at_level("WARNING"):
        optimizer = build_optimizer(resnet, _optim_cfg())
    assert _muon_names(resnet, optimizer) == set()  # 4-D kernels, and the head
    assert "every parameter trains with AdamW" in caplog.text


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_step_is_torchs_muon_and_adamw_stepped_separately():
    ours, theirs = _vit(), _vit()
    optimizer = build_optimizer(ours, _optim_cfg())
    set_lr(optimizer, LR)
    muon_names = _muon_names(ours, optimizer)
    params = dict(theirs.named_parameters())
    decayed = [p for n, p in params.items() if n not in muon_names and p.ndim > 1]
    plain = [p for n, p in params.items() if n not in muon_names and p.ndim <= 1]
    reference = [
        torch.optim.Muon(
            [params[n] for n in sorted(muon_names)], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw"
        ),
        torch.optim.AdamW(
            [{"params": decayed, "weight_decay": WD}, {"params": plain, "weight_decay": 0.0}], lr=LR, fused=True
        ),
    ]
    for _ in range(3):
        _one_step(ours, optimizer)
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        nn.functional.cross_entropy(theirs(x), torch.tensor([0, 1, 2, 3])).backward()
        for o in reference:
            o.step()
            o.zero_grad()
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert torch.equal(q, p), name


@pytest.mark.parametrize("shape", [(32, 16), (16, 48), (24, 24)])
def test_the_first_step_is_newton_schulz_on_the_gradients_singular_values(shape):
    """Muon's first step from zero momentum: W1 = W0 (1 - lr wd) - lr 0.2 sqrt(max(A, B)) U f(S / |S|) V^T
    for a gradient U S V^T, f the quintic p(x) = 3.4445 x - 4.775 x^3 + 2.0315 x^5 applied five times
    (Newton-Schulz acts on each singular value alone): computed here in float64 from a gradient made
    with known singular vectors and values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False), nn.ReLU(), nn.Linear(shape[0], 10))
    optimizer = build_optimizer(model, _optim_cfg())
    set_lr(optimizer, LR)
    g, k = torch.Generator().manual_seed(1), min(shape)
    u = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=torch.float64))[0]
    singular = torch.linspace(1.0, 0.2, k, dtype=torch.float64)
    weight, before = model[0].weight, model[0].weight.detach().double().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    weight.grad = ((u * singular) @ v.T).float()
    optimizer.step()
    x = singular / singular.norm()
    for _ in range(5):
        x = 3.4445 * x - 4.775 * x**3 + 2.0315 * x**5
    expected = (u * x) @ v.T
    update = (before * (1 - LR * WD) - weight.detach().double()) / (LR * 0.2 * max(shape) ** 0.5)
    # torch iterates in bf16 (2**-8 relative): a few ulps of the largest entry a matmul, over five
    # iterations; 8 ulps of it (0.008-0.011 measured).
    assert (update - expected).abs().max() < 8 * 2**-8 * expected.abs().max()
    assert 0.6 < x.min() and x.max() < 1.2  # the band Newton-Schulz leaves the singular values in


def _state_round_trip(save, load) -> None:
    model = _vit()
    optimizer = build_optimizer(model, _optim_cfg())
    _one_step(model, optimizer)
    saved = save(model, optimizer)
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(resumed_model, _optim_cfg())
    load(resumed_model, resumed, saved)
    assert [g["muon"] for g in resumed.param_groups] == [g["muon"] for g in optimizer.param_groups]
    for _ in range(2):
        _one_step(model, optimizer)
        _one_step(resumed_model, resumed)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_the_state_resumes_exactly_through_a_state_dict():
    _state_round_trip(lambda m, o: copy.deepcopy(o.state_dict()), lambda m, o, s: o.load_state_dict(s))


def test_the_state_resumes_exactly_through_dcps_state_dict():
    """What a sharded checkpoint saves (training/components.py: get/set_optimizer_state_dict)."""
    _state_round_trip(
        lambda m, o: copy.deepcopy(get_optimizer_state_dict(m, o)), lambda m, o, s: set_optimizer_state_dict(m, o, s)
    )


def test_muon_refuses_zero_and_an_unknown_lr_adjustment():
    with pytest.raises(ConfigError, match=r"^OPTIM.ZERO cannot combine with OPTIM.OPTIMIZER muon"):
        load_cfg(None, ["OPTIM.OPTIMIZER", "muon", "OPTIM.ZERO", "True"])
    with pytest.raises(ConfigError, match=r"^OPTIM.MUON_ADJUST_LR must be one of"):
        load_cfg(None, ["OPTIM.MUON_ADJUST_LR", "rms"])
