"""FSDP2 building blocks: blocks found per architecture, the mixed-precision policy, the mesh, and the
config errors. (FSDP/HSDP against DDP on 2 and 4 ranks: tests/integration/test_fsdp_runs.py.)"""

from __future__ import annotations

import functools

import pytest
import torch
import torchvision
from torch import nn

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.models import enable_grad_checkpointing, find_blocks, has_batchnorm, named_blocks
from distribuuuu.runtime.parallel import build_mesh, mixed_precision_policy
from distribuuuu.training.optim import layer_ids


def _meta_model(arch: str) -> nn.Module:
    if arch in ("swin_t", "regnet_y_400mf", "maxvit_t"):  # their constructors read tensor values: not on "meta"
        return torchvision.models.get_model(arch, num_classes=10)
    with torch.device("meta"):  # no weights allocated: the module tree is all that is looked at
        return torchvision.models.get_model(arch, num_classes=10)


@pytest.mark.parametrize(
    ("arch", "block_class", "count"),
    [
        ("resnet18", "BasicBlock", 8),
        ("resnet50", "Bottleneck", 16),
        ("vit_b_16", "EncoderBlock", 12),
        ("convnext_tiny", "CNBlock", 18),
        ("efficientnet_b0", "MBConv", 16),
        ("mobilenet_v3_small", "InvertedResidual", 11),
        ("swin_t", "SwinTransformerBlock", 12),
        ("regnet_y_400mf", "ResBottleneckBlock", 16),
        ("shufflenet_v2_x0_5", "InvertedResidual", 16),
        ("maxvit_t", "MaxVitLayer", 11),
    ],
)
def test_blocks_of_torchvision_models_are_their_residual_or_encoder_blocks(arch, block_class, count):
    names = [type(b).__name__ for b in find_blocks(_meta_model(arch))]
    # Stems, last convs and downsampling (ConvNeXt's, Swin's PatchMerging) are no blocks: they stay with the root.
    assert names == [block_class] * count, names


@pytest.mark.parametrize(
    "arch", ["resnet18", "vit_b_16", "convnext_tiny", "swin_t", "efficientnet_b0", "regnet_y_400mf"]
)
def test_fsdp_gradient_checkpointing_and_layer_decay_see_the_same_blocks(arch):
    model = _meta_model(arch)
    blocks = named_blocks(model)
    ids, num_layers = layer_ids(model)
    assert num_layers == len(blocks)
    for layer, (name, block) in enumerate(blocks, 1):  # block i's parameters are layer i, in forward order
        assert {ids[f"{name}.{p}"] for p, _ in block.named_parameters()} == {layer}, name
    assert enable_grad_checkpointing(model) == len(blocks)
    assert all(isinstance(block.forward, functools.partial) for _, block in blocks), "every block recomputes"


def test_timm_blocks_not_stages():
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10)
    assert [type(b).__name__ for b in find_blocks(vit)] == ["Block"] * 12
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    assert {type(b).__name__ for b in find_blocks(convnext)} == {"ConvNeXtBlock"}


def test_a_model_may_name_its_own_blocks():
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def fsdp_blocks(self):
            return list(self.trunk)

    model = Named()
    assert find_blocks(model) == list(model.trunk)


def test_mixed_precision_policy_16_bit_params_fp32_reduce_none_for_fp32_and_batchnorm():
    vit, resnet = _meta_model("vit_b_16"), _meta_model("resnet18")
    policy = mixed_precision_policy("bf16", has_batchnorm(vit))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("fp16", has_batchnorm(vit)).param_dtype == torch.float16
    assert mixed_precision_policy("fp32", has_batchnorm(vit)) is None
    assert mixed_precision_policy("bf16", has_batchnorm(resnet)) is None  # BatchNorm: fp32 params + autocast
    with pytest.raises(ValueError, match="TRAIN.PRECISION"):
        mixed_precision_policy("fp8", has_batchnorm(vit))


def test_hsdp_refuses_uneven_nodes():
    with pytest.raises(ValueError, match="not a multiple of 4 per node"):
        build_mesh("hsdp", 6, 4)
    with pytest.raises(ValueError, match="DIST.STRATEGY"):
        build_mesh("ddp", 2, 2)


@pytest.mark.parametrize(
    "opts, names",
    [
        (["DIST.STRATEGY", "zero3"], ["DIST.STRATEGY"]),
        (["DIST.STRATEGY", "fsdp", "OPTIM.ZERO", "True"], ["DIST.STRATEGY", "OPTIM.ZERO"]),
        (["DIST.STRATEGY", "hsdp", "DIST.COMM_HOOK", "bf16"], ["DIST.STRATEGY", "DIST.COMM_HOOK"]),
        (["DIST.STRATEGY", "fsdp", "DIST.CKPT_FORMAT", "file"], ["DIST.CKPT_FORMAT", "DIST.STRATEGY"]),
        (["DIST.CKPT_FORMAT", "zip"], ["DIST.CKPT_FORMAT"]),
        (["DIST.CKPT_FORMAT", "sharded", "OPTIM.ZERO", "True"], ["DIST.CKPT_FORMAT", "OPTIM.ZERO"]),
    ],
)
def test_combinations_fsdp_cannot_run_are_one_config_error_naming_the_keys(opts, names):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, opts)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in names), str(e.value)
    load_cfg(None, opts[:2] if len(opts) > 2 else [])  # each key alone is valid
