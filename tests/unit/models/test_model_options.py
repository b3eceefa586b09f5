"""Model options and the evaluation transform: pretrained weights by name,
MODEL.KWARGS, zero-initialised residual BatchNorm, activation checkpointing (full, selective, timm's own), TEST.CROP_SIZE /
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
from distribuuuu.models import enable_activation_checkpointing, enable_grad_checkpointing
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


def _recorded_checkpoints(monkeypatch) -> list:
    """The blocks torch.utils.checkpoint is called on (the bound forward's module), from now on."""
    calls, original = [], torch.utils.checkpoint.checkpoint

    def recording(function, *args, **kwargs):
        calls.append((getattr(function, "__self__", None), kwargs))
        return original(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", recording)
    return calls


def _train_twice(model: torch.nn.Module, images: torch.Tensor) -> tuple[list, list]:
    """Two forward-backward passes in training mode: the losses and the accumulated gradients."""
    model.train()
    targets = torch.arange(len(images)) % 10
    losses = [torch.nn.functional.cross_entropy(model(images), targets) for _ in range(1)]
    losses[0].backward()
    losses.append(torch.nn.functional.cross_entropy(model(images * 0.5), targets))
    losses[1].backward()
    return losses, [p.grad for p in model.parameters()]


def _assert_same_training(plain: torch.nn.Module, checkpointed: torch.nn.Module, images: torch.Tensor) -> None:
    """Same losses, gradients and buffers (BatchNorm's running statistics updated once a step, not twice)."""
    (plain_losses, plain_grads), (losses, grads) = _train_twice(plain, images), _train_twice(checkpointed, images)
    for ours, reference in zip(losses, plain_losses):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    for (name, _), ours, reference in zip(plain.named_parameters(), grads, plain_grads):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7, msg=name)
    for (name, b), c in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(c, b), name


@pytest.mark.parametrize(
    ("mode", "every", "blocks"),
    [("full", 1, [1, 2, 3, 4, 5, 6, 7, 8]), ("selective", 2, [2, 4, 6, 8]), ("selective", 3, [3, 6])],
)
def test_activation_checkpointing_gives_the_unchecked_losses_gradients_and_batchnorm_statistics(
    monkeypatch, mode, every, blocks
):
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    checkpointed = copy.deepcopy(plain)
    calls = _recorded_checkpoints(monkeypatch)
    assert enable_activation_checkpointing(checkpointed, mode, every) == len(blocks)
    _assert_same_training(plain, checkpointed, torch.randn(4, 3, 16, 16))
    all_blocks = models.find_blocks(checkpointed)
    assert [all_blocks.index(block) + 1 for block, _ in calls] == blocks * 2  # blocks k, 2k, ... each step
    assert all(k["use_reentrant"] is False for _, k in calls)
    checkpointed.eval()
    with torch.no_grad():
        checkpointed(torch.randn(4, 3, 16, 16))  # evaluation runs the blocks plainly
    assert len(calls) == 2 * len(blocks)


def test_the_original_grad_checkpoint_key_is_full_and_the_config_picks_every_kth_block(monkeypatch):
    calls = _recorded_checkpoints(monkeypatch)

    def checkpoints(*opts: str) -> int:
        calls.clear()
        model = build_configured_model(load_cfg(opts=list(opts)).MODEL)
        model(torch.randn(2, 3, 16, 16)).sum().backward()
        return len(calls)

    assert enable_grad_checkpointing(torchvision.models.resnet18()) == 8
    assert checkpoints("MODEL.GRAD_CHECKPOINT", "True") == checkpoints("MODEL.ACTIVATION_CHECKPOINTING", "full") == 8
    assert checkpoints("MODEL.ACTIVATION_CHECKPOINTING", "selective", "MODEL.ACTIVATION_CHECKPOINTING_EVERY", "3") == 2
    assert checkpoints() == 0
    with pytest.raises(
        ConfigError, match=r"^MODEL.GRAD_CHECKPOINT must be False with MODEL.ACTIVATION_CHECKPOINTING selective"
    ):
        load_cfg(opts=["MODEL.GRAD_CHECKPOINT", "True", "MODEL.ACTIVATION_CHECKPOINTING", "selective"])
    with pytest.raises(
        ConfigError, match=r"^MODEL.ACTIVATION_CHECKPOINTING must be one of \('none', 'full', 'selective'\)"
    ):
        load_cfg(opts=["MODEL.ACTIVATION_CHECKPOINTING", "some"])
    with pytest.raises(ConfigError, match=r"^MODEL.ACTIVATION_CHECKPOINTING_EVERY must be >= 1, got 0"):
        load_cfg(opts=["MODEL.ACTIVATION_CHECKPOINTING_EVERY", "0"])


def _saved_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of one forward (a checkpointed block keeps none of its own)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(images).sum()
    loss.backward()
    return total


@pytest.mark.parametrize("arch", ["resnet18", "vit"])
def test_checkpointing_keeps_fewer_activations_for_backward_the_more_blocks_it_takes(arch):
    def build(mode: str = "none", every: int = 1) -> torch.nn.Module:
        torch.manual_seed(0)
        model = (
            torchvision.models.resnet18(num_classes=10)
            if arch == "resnet18"
            else torchvision.models.VisionTransformer(32, 4, 4, 2, 32, 64, num_classes=10)
        )
        enable_activation_checkpointing(model, mode, every)
        return model.train()

    images = torch.randn(8, 3, 32, 32)
    kept = {m: _saved_bytes(build(*m), images) for m in [("none",), ("selective", 2), ("full",)]}
    assert kept[("none",)] > kept[("selective", 2)] > kept[("full",)] > 0, kept


def test_a_timm_model_checkpoints_itself_unless_it_has_batchnorm(monkeypatch):
    """timm's own checkpointing recomputes BatchNorm's forward in training mode: its running statistics
    are updated twice a step (checked here), so a timm model with BatchNorm is wrapped block by block."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, num_classes=10)
    checkpointed_vit = copy.deepcopy(vit)
    assert enable_activation_checkpointing(checkpointed_vit, "full") == -1 and checkpointed_vit.grad_checkpointing
    _assert_same_training(vit, checkpointed_vit, torch.randn(4, 3, 16, 16))
    resnet = timm.create_model("resnet18", num_classes=10)
    timms_own = copy.deepcopy(resnet)
    timms_own.set_grad_checkpointing(True)
    _train_twice(timms_own, torch.randn(4, 3, 16, 16))
    assert int(timms_own.layer1[0].bn1.num_batches_tracked) == 4  # two steps counted twice each
    ours = copy.deepcopy(resnet)
    assert enable_activation_checkpointing(ours, "full") == 8 and not getattr(ours, "grad_checkpointing", False)
    _assert_same_training(resnet, ours, torch.randn(4, 3, 16, 16))


@pytest.mark.slow
def test_a_compiled_checkpointed_model_trains_as_the_plain_one():
    """Under torch.compile the recomputation runs inside the compiled graph (dynamo refuses the eager
    path's context manager, and a compiled graph updates a buffer once): same gradients, same statistics."""
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), BasicBlock(8, 8), BasicBlock(8, 8), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 10),
    )  # fmt: skip
    checkpointed = copy.deepcopy(plain)
    assert enable_activation_checkpointing(checkpointed, "full") == 2
    _assert_same_training(torch.compile(plain), torch.compile(checkpointed), torch.randn(4, 3, 16, 16))


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
