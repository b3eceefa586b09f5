"""Model options and the evaluation transform: pretrained weights by name,
MODEL.KWARGS, zero-initialised residual BatchNorm, gradient checkpointing, TEST.CROP_SIZE /
CROP_PCT / INTERPOLATION and a timm model's own preprocessing. Nothing is downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
import torchvision
from torchvision.transforms import v2

from distribuuuu import models
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.models import enable_grad_checkpointing
from distribuuuu.training.parallelize import build_configured_model
from distribuuuu.training.preprocessing import build_val_transform, eval_preprocessing


def test_an_unknown_torchvision_weight_name_is_one_config_error_listing_the_valid_names():
    cfg = load_cfg(opts=["MODEL.ARCH", "resnet50", "MODEL.PRETRAINED_WEIGHTS", "IMAGENET1K_V3"])
    with pytest.raises(ConfigError) as e:
        build_configured_model(cfg.MODEL)
    assert str(e.value) == (
        "MODEL.PRETRAINED_WEIGHTS: resnet50 has no weights 'IMAGENET1K_V3'; "
        "valid names: ['DEFAULT', 'IMAGENET1K_V1', 'IMAGENET1K_V2']"
    )


@pytest.mark.parametrize(("name", "expected"), [("IMAGENET1K_V1", "IMAGENET1K_V1"), ("DEFAULT", "IMAGENET1K_V2")])
def test_torchvision_weights_by_name_fetch_that_enums_file(monkeypatch, name, expected):
    imagenet = torchvision.models.resnet50(num_classes=1000).state_dict()
    urls = []
    monkeypatch.setattr(
        torchvision.models._api, "load_state_dict_from_url", lambda url, **k: urls.append(url) or imagenet
    )
    model = build_configured_model(load_cfg(opts=["MODEL.ARCH", "resnet50", "MODEL.PRETRAINED_WEIGHTS", name]).MODEL)
    assert urls == [torchvision.models.ResNet50_Weights[expected].url]
    assert torch.equal(model.state_dict()["conv1.weight"], imagenet["conv1.weight"])


def test_an_unknown_timm_tag_is_one_config_error_listing_the_models_tags():
    pytest.importorskip("timm")
    cfg = load_cfg(opts=["MODEL.ARCH", "resnet18d", "MODEL.PRETRAINED_WEIGHTS", "b9_in1k"])
    with pytest.raises(
        ConfigError,
        match=r"^MODEL.PRETRAINED_WEIGHTS: timm has no 'b9_in1k' weights for resnet18d; its tags: \[.*'ra2_in1k'",
    ):
        build_configured_model(cfg.MODEL)


def test_model_kwargs_reach_the_constructor_and_an_unknown_one_names_the_key():
    model = build_configured_model(
        load_cfg(opts=["MODEL.ARCH", "mobilenet_v2", "MODEL.KWARGS", "['dropout=0.35', 'width_mult=0.5']"]).MODEL
    )
    assert model.classifier[0].p == 0.35 and model.features[0][0].out_channels == 16  # 32 x 0.5
    with pytest.raises(ConfigError, match=r"^MODEL.KWARGS \['dropout=0.3'\]: resnet18 refuses them"):
        build_configured_model(load_cfg(opts=["MODEL.KWARGS", "['dropout=0.3']"]).MODEL)
    with pytest.raises(ConfigError, match=r'^MODEL.KWARGS must be a list of "name=value" strings'):
        load_cfg(opts=["MODEL.KWARGS", "['dropout 0.3']"])


def test_zero_init_residual_matches_torchvisions_own_for_resnets():
    for arch, cls in (("resnet18", torchvision.models.resnet18), ("resnet50", torchvision.models.resnet50)):
        torch.manual_seed(0)
        ours = build_configured_model(load_cfg(opts=["MODEL.ARCH", arch, "MODEL.ZERO_INIT_RESIDUAL", "True"]).MODEL)
        torch.manual_seed(0)
        theirs = cls(num_classes=10, zero_init_residual=True)
        mine, reference = ours.state_dict(), theirs.state_dict()
        assert all(torch.equal(mine[k], reference[k]) for k in reference), arch


def test_zero_init_residual_reaches_regnets_blocks_but_not_their_shortcut_and_leaves_other_models_as_built():
    model = build_configured_model(
        load_cfg(opts=["MODEL.ARCH", "regnet_y_400mf", "MODEL.ZERO_INIT_RESIDUAL", "True"]).MODEL
    )
    blocks = [m for m in model.modules() if type(m).__name__ == "ResBottleneckBlock"]
    assert blocks and all(torch.all(b.f.c[1].weight == 0) for b in blocks)
    assert all(torch.all(b.proj[1].weight == 1) for b in blocks if b.proj is not None)
    for arch in ("alexnet", "mobilenet_v2", "shufflenet_v2_x0_5"):  # none adds a zero-able residual branch
        torch.manual_seed(0)
        ours = build_configured_model(load_cfg(opts=["MODEL.ARCH", arch, "MODEL.ZERO_INIT_RESIDUAL", "True"]).MODEL)
        torch.manual_seed(0)
        reference = torchvision.models.get_model(arch, num_classes=10).state_dict()
        assert all(torch.equal(ours.state_dict()[k], v) for k, v in reference.items()), arch


def test_zero_init_residual_is_the_default_and_never_touches_pretrained_weights(monkeypatch):
    model = build_configured_model(load_cfg(opts=["MODEL.ARCH", "resnet18"]).MODEL)
    assert all(torch.all(block.bn2.weight == 0) for layer in (model.layer1, model.layer4) for block in layer)
    loaded = []
    monkeypatch.setattr(models.zoo, "_load_torchvision_pretrained", lambda model, arch, weights: loaded.append(weights))
    pretrained = build_configured_model(load_cfg(opts=["MODEL.ARCH", "resnet18", "MODEL.PRETRAINED", "True"]).MODEL)
    assert loaded == ["DEFAULT"] and all(torch.all(m.bn2.weight == 1) for m in pretrained.layer1)


def test_gradient_checkpointing_gives_the_same_loss_gradients_and_batchnorm_statistics(monkeypatch):
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    checkpointed = copy.deepcopy(plain)
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(k) or original(*a, **k))
    assert enable_grad_checkpointing(checkpointed) == 8  # resnet18's eight BasicBlocks
    images, targets = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    losses = []
    for model in (plain, checkpointed):
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        losses.append(loss)
    assert len(calls) == 8 and all(k["use_reentrant"] is False for k in calls)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, b), c in zip(plain.named_buffers(), checkpointed.buffers()):  # recomputation left them alone
        assert torch.equal(c, b), name
    checkpointed.eval()
    with torch.no_grad():
        checkpointed(images)  # evaluation runs the blocks plainly
    assert len(calls) == 8


def test_the_eval_transform_resizes_crops_and_interpolates_as_configured():
    cfg = load_cfg(
        opts=["TRAIN.IM_SIZE", "176", "TEST.CROP_SIZE", "224", "TEST.IM_SIZE", "232", "TEST.INTERPOLATION", "bicubic"]
    )
    image = torch.randint(0, 256, (3, 300, 400), dtype=torch.uint8)
    out = build_val_transform(cfg)(image)
    assert out.shape == (3, 224, 224)
    # Written out with torchvision's functional ops: shorter side to 232, bicubic; center 224; normalise.
    resized = v2.functional.resize(image, [232, 309], interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    cropped = resized[:, 4:228, 42:266].float() / 255
    mean, std = torch.tensor(cfg.DATA.MEAN).view(3, 1, 1), torch.tensor(cfg.DATA.STD).view(3, 1, 1)
    torch.testing.assert_close(out, (cropped - mean) / std, rtol=0, atol=1e-5)


def test_crop_pct_sets_the_resize_as_timm_does_and_the_defaults_keep_todays_transform():
    default = eval_preprocessing(load_cfg())
    assert (default.resize, default.crop, default.interpolation) == (32, 32, "bilinear")  # TEST.IM_SIZE, TRAIN.IM_SIZE
    pct = eval_preprocessing(
        load_cfg(opts=["TRAIN.IM_SIZE", "224", "TEST.CROP_PCT", "0.875", "TEST.INTERPOLATION", "nearest"])
    )
    assert (pct.resize, pct.crop, pct.interpolation) == (256, 224, "nearest")
    with pytest.raises(ConfigError, match=r"^TEST.IM_SIZE must be >= TEST.CROP_SIZE \(0: TRAIN.IM_SIZE\), got 200"):
        load_cfg(opts=["TRAIN.IM_SIZE", "176", "TEST.CROP_SIZE", "224", "TEST.IM_SIZE", "200"])


def test_a_pretrained_timm_model_brings_its_own_preprocessing_unless_the_config_sets_it():
    timm = pytest.importorskip("timm")
    base = [
        "MODEL.ARCH",
        "vit_tiny_patch16_224",
        "MODEL.PRETRAINED_WEIGHTS",
        "augreg_in21k_ft_in1k",
        "TRAIN.IM_SIZE",
        "224",
    ]
    reference = timm.data.resolve_data_config(
        {}, pretrained_cfg=timm.models.get_pretrained_cfg("vit_tiny_patch16_224.augreg_in21k_ft_in1k").to_dict()
    )
    own = eval_preprocessing(load_cfg(opts=[*base, "TEST.IM_SIZE", "224"]))
    assert (own.mean, own.std, own.interpolation) == (reference["mean"], reference["std"], reference["interpolation"])
    assert own.resize == int(224 / reference["crop_pct"])
    explicit = [
        "DATA.MEAN",
        "[0.4, 0.4, 0.4]",
        "TEST.INTERPOLATION",
        "bilinear",
        "TEST.CROP_PCT",
        "1.0",
        "TEST.IM_SIZE",
        "224",
    ]
    mine = eval_preprocessing(load_cfg(opts=[*base, *explicit]))
    assert (mine.mean, mine.interpolation, mine.resize) == ((0.4, 0.4, 0.4), "bilinear", 224)
    unpretrained = eval_preprocessing(
        load_cfg(opts=["MODEL.ARCH", "vit_tiny_patch16_224", "TRAIN.IM_SIZE", "224", "TEST.IM_SIZE", "240"])
    )
    assert (unpretrained.interpolation, unpretrained.resize) == ("bilinear", 240)
    assert models.timm_pretrained_cfg(base[1], None) is None  # no pretrained weights: nothing of timm's
