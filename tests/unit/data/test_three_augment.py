"""3-Augment (DeiT III), DATA.AUTO_AUGMENT threeaugment: per image one of grayscale, solarization and
Gaussian blur, each a third of the time, then colour jitter (DATA.COLOR_JITTER).

Checked against the operations written out with torchvision's functional API (an independent
computation of each choice) and against the choice frequencies' binomial bounds.
"""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data.transforms import three_augment
from distribuuuu.training.preprocessing import build_train_transform

DRAWS = 300


def _image(seed: int) -> torch.Tensor:
    """A 3 x 16 x 16 uint8 image with structure (a blur changes it) and colour (grayscale does)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g)


def _total_variation(image: torch.Tensor) -> float:
    x = image.double()
    return float((x[:, 1:] - x[:, :-1]).abs().sum() + (x[:, :, 1:] - x[:, :, :-1]).abs().sum())


def _which(image: torch.Tensor, out: torch.Tensor) -> str:
    """Which of the three operations made ``out`` from ``image`` (no colour jitter)."""
    if torch.equal(out, F.rgb_to_grayscale(image, num_output_channels=3)):
        return "grayscale"
    if torch.equal(out, F.solarize(image, threshold=128)):
        return "solarize"
    # A Gaussian blur of sigma in [0.1, 2]: it lowers the total variation, and no more than sigma 2's
    # blur does (convolution with a probability kernel never raises it; rounding to uint8 moves it by
    # at most one level a pixel pair).
    slack = 2.0 * image[0].numel() * 3
    strongest = F.gaussian_blur(image, kernel_size=13, sigma=2.0)
    assert _total_variation(strongest) - slack <= _total_variation(out) <= _total_variation(image) + slack
    low, high = image.amin(dim=(1, 2)), image.amax(dim=(1, 2))  # a weighted mean of each channel's own pixels
    assert ((out >= low.view(3, 1, 1)) & (out <= high.view(3, 1, 1))).all()
    return "blur"


def test_each_image_gets_one_of_grayscale_solarize_and_blur_a_third_of_the_time():
    augment = three_augment(color_jitter=0.0)
    torch.manual_seed(0)
    counts = {"grayscale": 0, "solarize": 0, "blur": 0}
    for i in range(DRAWS):
        image = _image(i)
        counts[_which(image, augment(image))] += 1
    # Binomial(300, 1/3): standard deviation 8.2; 4.5 standard deviations either way.
    bound = 4.5 * math.sqrt(DRAWS * (1 / 3) * (2 / 3))
    assert all(abs(c - DRAWS / 3) < bound for c in counts.values()), counts


def test_the_blur_is_the_functional_gaussian_blur_at_the_drawn_sigma(monkeypatch):
    """The blur branch blurs with a sigma drawn uniformly in [0.1, 2], as DeiT III's PIL blur radius."""
    sigmas, make_params = [], v2.GaussianBlur.make_params

    def recording(self, flat_inputs):
        params = make_params(self, flat_inputs)
        sigmas.append(params["sigma"])
        return params

    monkeypatch.setattr(v2.GaussianBlur, "make_params", recording)
    augment, image = three_augment(color_jitter=0.0), _image(7)
    torch.manual_seed(1)
    outputs = [augment(image) for _ in range(60)]
    others = (F.rgb_to_grayscale(image, num_output_channels=3), F.solarize(image, threshold=128))
    blurred = [out for out in outputs if not any(torch.equal(out, o) for o in others)]
    assert len(blurred) == len(sigmas) > 0  # every other output is grayscale or solarized
    for out, sigma in zip(blurred, sigmas):
        assert 0.1 <= sigma[0] <= 2.0 and sigma[0] == sigma[1]
        assert torch.equal(out, F.gaussian_blur(image, kernel_size=[13, 13], sigma=sigma))


def test_colour_jitter_follows_the_chosen_operation():
    """With jitter, an image is the jitter of one of the three operations: brightness, contrast and
    saturation within 1 +- DATA.COLOR_JITTER; a grayscale image stays gray (saturation has nothing to move)."""
    augment = three_augment(color_jitter=0.3)
    torch.manual_seed(2)
    gray_outputs = 0
    for i in range(60):
        out = augment(_image(i))
        assert out.dtype == torch.uint8 and out.shape == (3, 16, 16)
        gray_outputs += bool((out[0] == out[1]).all() and (out[1] == out[2]).all())
    assert 5 <= gray_outputs <= 40  # a third of 60 are grayscale first, and jitter keeps them gray


def test_the_config_builds_it_after_the_crop_and_refuses_a_negative_jitter():
    cfg = load_cfg(None, ["DATA.AUTO_AUGMENT", "threeaugment", "DATA.COLOR_JITTER", "0.3", "TRAIN.IM_SIZE", "24"])
    names = [type(t).__name__ for t in build_train_transform(cfg, normalize=False).transforms]
    assert names[:2] == ["ToImage", "RandomResizedCrop"] and names[-1] == "Compose"
    inner = [type(t).__name__ for t in build_train_transform(cfg, normalize=False).transforms[-1].transforms]
    assert inner == ["RandomChoice", "ColorJitter"]
    with pytest.raises(ConfigError, match=r"^DATA.COLOR_JITTER must be >= 0, got -0.1"):
        load_cfg(None, ["DATA.COLOR_JITTER", "-0.1"])
