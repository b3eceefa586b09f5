"""Train/val transforms and batch-level mixup/cutmix, all from torchvision.transforms.v2; knows
nothing of the config (``training/inputs.py`` translates it into ``TrainAugment``, ``EvalPreprocessing``
and ``MixOptions``).

The per-sample transforms end in uint8 pixels: a batch travels from the workers and over to the
device at a quarter of float32's bytes, and ``Normalize`` turns it into normalised floats there,
once per batch (on a GPU at no cost to the data-loading cores). ``normalize`` appends the same step
for one image at a time (predict, export).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch.nn.functional import one_hot
from torchvision.transforms import v2

from distribuuuu.data.draft import DraftDecode, DraftRandomResizedCrop
from distribuuuu.data.resample import EvalGeometry, TrainGeometry

logger = logging.getLogger("distribuuuu.data")


@dataclass(frozen=True)
class TrainAugment:
    """The training augmentation: a random resized crop to ``size`` over (``crop_scale_min``, 1) of
    the image, a flip, an auto-augment policy, random erasing to ``erase_fill`` (the mean colour in
    pixels); ``draft``: JPEGs arrive undecoded and the crop decodes them at a reduced scale."""

    size: int
    crop_scale_min: float = 0.08
    hflip_prob: float = 0.5
    auto_augment: str = ""  # "", "randaugment", "trivialaugment", "autoaugment", "threeaugment"
    randaugment_magnitude: int = 9
    random_erasing: float = 0.0
    erase_fill: tuple[int, ...] = (124, 116, 104)
    draft: bool = False
    color_jitter: float = 0.0  # threeaugment's colour jitter after its operation

    def at(self, size: int) -> TrainAugment:
        """The same augmentation to another crop size (progressive resizing: one per size)."""
        return replace(self, size=size)


def train_transform(aug: TrainAugment, normalize: Normalize | None = None) -> Callable:
    """Crop + flip [+ auto-augment] [+ random erasing], uint8 pixels throughout [+ ``normalize``]."""
    steps = [*_crop_and_flip(aug), *_after_crop_and_flip(aug)]
    return v2.Compose(steps + ([normalize] if normalize is not None else []))


def _random_resized_crop(aug: TrainAugment) -> v2.RandomResizedCrop:
    return v2.RandomResizedCrop(aug.size, scale=(aug.crop_scale_min, 1.0), antialias=True)


def _crop_and_flip(aug: TrainAugment) -> list[Callable]:
    if aug.draft:  # JPEGs arrive undecoded: the crop decodes them at a reduced scale
        steps = [DraftRandomResizedCrop(aug.size, scale=(aug.crop_scale_min, 1.0), antialias=True)]
    else:
        steps = [v2.ToImage(), _random_resized_crop(aug)]
    return steps + ([v2.RandomHorizontalFlip(aug.hflip_prob)] if aug.hflip_prob > 0 else [])


def _after_crop_and_flip(aug: TrainAugment) -> list[Callable]:
    steps = []
    policy = {
        "randaugment": lambda: v2.RandAugment(magnitude=aug.randaugment_magnitude),
        "trivialaugment": v2.TrivialAugmentWide,
        "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
        "threeaugment": lambda: three_augment(aug.color_jitter),
    }.get(aug.auto_augment)
    if policy is not None:
        steps.append(policy())
    if aug.random_erasing > 0:  # erased to the mean colour: about 0 once normalised
        steps.append(RandomErasing(p=aug.random_erasing, value=list(aug.erase_fill)))
    return steps


# 3-Augment's blur kernel: +-3 sigma at its largest sigma, 2, where PIL's GaussianBlur (DeiT III's) has no cut.
_BLUR_KERNEL = 13


def three_augment(color_jitter: float) -> Callable:
    """DeiT III's 3-Augment (Touvron et al., 2022; timm's "3a"): per image one of grayscale, solarization
    at 128 and a Gaussian blur of sigma uniform in [0.1, 2], each with probability 1/3, then colour
    jitter of brightness, contrast and saturation by ``color_jitter`` (0: none). torchvision's ops
    on uint8 tensors, so it runs in the workers or after the batched crop alike."""
    choice = v2.RandomChoice(
        [v2.Grayscale(num_output_channels=3), v2.RandomSolarize(128, p=1.0), v2.GaussianBlur(_BLUR_KERNEL, (0.1, 2.0))]
    )
    jitter = [v2.ColorJitter(color_jitter, color_jitter, color_jitter)] if color_jitter > 0 else []
    return v2.Compose([choice, *jitter])


def batched_train_steps(aug: TrainAugment) -> tuple[TrainGeometry, Callable | None]:
    """DATA.DECODER batched's training transform: the crop and flip as one batched resample
    (resample.TrainGeometry), and the steps it cannot do on the whole batch, or None.

    The one place that says what the batched resample cannot do: an auto-augment policy and
    random erasing pick different operations image by image. They run after it, per sample, on
    its crops rounded to uint8 (as today's per-sample resize rounds), with the sample's own draws,
    rather than refusing the config: a recipe keeps its augmentation and still gets the batched
    decode and crop (logged once, in one line).
    """
    tail = _after_crop_and_flip(aug)
    if tail:
        names = [
            k for k, on in (("DATA.AUTO_AUGMENT", aug.auto_augment), ("DATA.RANDOM_ERASING", aug.random_erasing)) if on
        ]
        logger.info("DATA.DECODER batched: %s run per sample after the batched crop", " and ".join(names))
    return batched_train_geometry(aug), v2.Compose(tail) if tail else None


def batched_train_geometry(aug: TrainAugment) -> TrainGeometry:
    """The batched resample's crop and flip (progressive resizing's workers draw each epoch's plans
    with that epoch's size: ``aug.at(size)``)."""
    return TrainGeometry(_random_resized_crop(aug), aug.hflip_prob)


def batched_eval_geometry(p: EvalPreprocessing) -> EvalGeometry | None:
    """Evaluation's resize and centre crop as one batched resample, or None where it cannot: an
    interpolation other than bilinear (a timm model's bicubic), which then runs per sample."""
    return EvalGeometry(p.resize, p.crop) if p.interpolation == "bilinear" else None


class RandomErasing(v2.RandomErasing):
    """v2.RandomErasing with its fill value moved to each device once.

    torchvision builds the fill on the CPU for every erased sample; writing it into an image on a
    GPU (DATA.DECODER batched augments there) is then a pageable host-to-device copy, which waits
    for everything queued on the training stream. Same draws, same pixels, no sync.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fill: dict[torch.device, torch.Tensor] = {}

    def transform(self, inpt, params: dict):
        if params["v"] is not None and self.value is not None and isinstance(inpt, torch.Tensor):
            if inpt.device not in self._fill:  # a constant: torch.tensor(self.value) in make_params
                self._fill[inpt.device] = params["v"].to(inpt.device)
            params = {**params, "v": self._fill[inpt.device]}
        return super().transform(inpt, params)


class Normalize:
    """``(pixels / 255 - mean) / std`` in float32 for uint8 ``[..., C, H, W]`` on any device.

    Written out rather than torchvision's ToDtype + Normalize: those rebuild the mean and std
    tensors and test std for zeros on every call, two host-device syncs per batch on a GPU (config
    validation already refuses a zero DATA.STD). Here the constants move to a device once.
    """

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.device not in self._on:
            self._on[pixels.device] = (self.mean.to(pixels.device), self.std.to(pixels.device))
        mean, std = self._on[pixels.device]
        return pixels.to(torch.float32).div_(255).sub_(mean).div_(std).as_subclass(torch.Tensor)


@dataclass(frozen=True)
class EvalPreprocessing:
    """What evaluation does to an image: resize the shorter side, center-crop, normalise.

    Checkpoints store it (``as_dict``): predict.py and export.py read it back, so a deployment
    preprocesses as the run's validation did without re-resolving the keys.
    """

    resize: int
    crop: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def as_dict(self) -> dict:
        """Plain ints, floats, str and lists: what a weights_only checkpoint load accepts."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, stored: dict) -> EvalPreprocessing:
        """The inverse of ``as_dict``."""
        return cls(**dict(stored, mean=tuple(stored["mean"]), std=tuple(stored["std"])))


def resolve_eval_preprocessing(
    crop: int,
    im_size: int,
    crop_pct: float,
    interpolation: str,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    model_defaults: dict,
) -> EvalPreprocessing:
    """Evaluation's preprocessing: a center crop of ``crop`` after resizing the shorter side to
    ``im_size``, or to crop / ``crop_pct`` (timm's rounding); the model's own values
    (``model_defaults``: a pretrained timm model's ``crop_pct``, ``interpolation``, ``mean``, ``std``)
    fill in the keys left unset (``crop_pct`` 0, ``interpolation`` "", ``mean``/``std`` None)."""
    crop_pct = crop_pct or model_defaults.get("crop_pct", 0.0)
    return EvalPreprocessing(
        resize=math.floor(crop / crop_pct) if crop_pct else im_size,
        crop=crop,
        interpolation=interpolation or model_defaults.get("interpolation", "bilinear"),
        mean=tuple(mean if mean is not None else model_defaults["mean"]),
        std=tuple(std if std is not None else model_defaults["std"]),
    )


def build_eval_transform(p: EvalPreprocessing, decoder: str = "auto", normalize: bool = True) -> Callable:
    """The transform of ``p`` (validation's, or a checkpoint's stored one for predict and export)."""
    steps = [
        DraftDecode(p.resize) if decoder == "draft" else v2.ToImage(),
        v2.Resize(p.resize, interpolation=v2.InterpolationMode[p.interpolation.upper()], antialias=True),
        v2.CenterCrop(p.crop),
    ]
    return v2.Compose(steps + [Normalize(p.mean, p.std)] if normalize else steps)


@dataclass(frozen=True)
class MixOptions:
    """Mixup and cutmix of a batch (DATA.MIXUP_ALPHA, CUTMIX_ALPHA, MIX_PROB, MIX_SWITCH_PROB), over
    ``num_classes`` outputs; ``multilabel``: multi-hot targets of batches of at most ``batch_size``."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    num_classes: int = 10
    multilabel: bool = False
    batch_size: int = 32


def batch_mixer(mix: MixOptions) -> Callable | None:
    """Return mixup/cutmix applied to a batch with probability ``mix.prob``, or None if disabled.

    The mixer maps (images, int targets) to (images, soft targets that sum to 1); for multi-label
    data, (images, multi-hot targets) to (images, the mixed multi-hot targets).
    """
    # torchvision's MixUp and CutMix take class indices only. A multi-label batch of n is handed to
    # them labelled 0..n-1 (at most batch_size "classes"): the soft targets they return are then the
    # n x n mixing weights of their very draws, and those weights times the multi-hot rows are the
    # mixed multi-hot targets.
    multilabel = mix.multilabel
    num_classes = mix.batch_size if multilabel else mix.num_classes
    choices, weights = [], []
    if mix.mixup_alpha > 0:
        choices.append(v2.MixUp(alpha=mix.mixup_alpha, num_classes=num_classes))
        weights.append(1.0 - mix.switch_prob if mix.cutmix_alpha > 0 else 1.0)
    if mix.cutmix_alpha > 0:
        choices.append(v2.CutMix(alpha=mix.cutmix_alpha, num_classes=num_classes))
        weights.append(mix.switch_prob if mix.mixup_alpha > 0 else 1.0)
    if not choices:
        return None
    mixing = v2.RandomChoice(choices, p=weights)

    def mixer(images: torch.Tensor, targets: torch.Tensor):
        # The coin is drawn on the CPU generator: no device sync, and saved in checkpoints.
        if mix.prob < 1.0 and torch.rand(()).item() >= mix.prob:
            return images, targets.to(images.dtype) if multilabel else one_hot(targets, num_classes).to(images.dtype)
        if multilabel:
            n = len(images)
            images, weights = mixing(images, torch.arange(n, device=images.device))
            return images, weights[:, :n] @ targets.to(weights.dtype)
        return mixing(images, targets)

    return mixer
