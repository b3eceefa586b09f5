"""Train/val transforms and batch-level mixup/cutmix, all from torchvision.transforms.v2.

The per-sample transforms end in uint8 pixels: a batch travels from the workers and over to the
device at a quarter of float32's bytes, and ``build_normalize`` turns it into normalised floats
there, once per batch (on a GPU at no cost to the data-loading cores). ``normalize=True`` appends
the same step for one image at a time (predict, export).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch.nn.functional import one_hot
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.config import eval_crop_size, get_cfg_defaults
from distribuuuu.data.draft import DraftDecode, DraftRandomResizedCrop
from distribuuuu.data.resample import EvalGeometry, TrainGeometry

logger = logging.getLogger("distribuuuu.data")


def build_train_transform(cfg: CfgNode, normalize: bool = True, size: int | None = None) -> Callable:
    """RandomResizedCrop(``size``, default TRAIN.IM_SIZE) + flip [+ auto-augment] [+ random erasing],
    uint8 pixels throughout [+ normalise]. Progressive resizing builds one per size (data/progressive.py)."""
    steps = [*_crop_and_flip(cfg, size), *_after_crop_and_flip(cfg)]
    if normalize:
        steps.append(build_normalize(cfg))
    return v2.Compose(steps)


def _random_resized_crop(cfg: CfgNode, size: int | None = None) -> v2.RandomResizedCrop:
    return v2.RandomResizedCrop(size or cfg.TRAIN.IM_SIZE, scale=(cfg.DATA.CROP_SCALE_MIN, 1.0), antialias=True)


def _crop_and_flip(cfg: CfgNode, size: int | None = None) -> list[Callable]:
    d, size = cfg.DATA, size or cfg.TRAIN.IM_SIZE
    if d.DECODER == "draft":  # JPEGs arrive undecoded: the crop decodes them at a reduced scale
        steps = [DraftRandomResizedCrop(size, scale=(d.CROP_SCALE_MIN, 1.0), antialias=True)]
    else:
        steps = [v2.ToImage(), _random_resized_crop(cfg, size)]
    return steps + ([v2.RandomHorizontalFlip(d.HFLIP_PROB)] if d.HFLIP_PROB > 0 else [])


def _after_crop_and_flip(cfg: CfgNode) -> list[Callable]:
    d = cfg.DATA
    steps = []
    policy = {
        "randaugment": lambda: v2.RandAugment(magnitude=d.RANDAUGMENT_MAGNITUDE),
        "trivialaugment": v2.TrivialAugmentWide,
        "autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    }.get(d.AUTO_AUGMENT)
    if policy is not None:
        steps.append(policy())
    p = eval_preprocessing(cfg)  # the same normalisation as evaluation (a timm model's own)
    if d.RANDOM_ERASING > 0:  # erased to the mean colour: about 0 once normalised
        steps.append(RandomErasing(p=d.RANDOM_ERASING, value=[round(255 * m) for m in p.mean]))
    return steps


def batched_train_steps(cfg: CfgNode) -> tuple[TrainGeometry, Callable | None]:
    """DATA.DECODER batched's training transform: the crop and flip as one batched resample
    (resample.TrainGeometry), and the steps it cannot do on the whole batch, or None.

    The one place that says what the batched resample cannot do: an AUTO_AUGMENT policy and
    RANDOM_ERASING pick different operations image by image. They run after it, per sample, on
    its crops rounded to uint8 (as today's per-sample resize rounds), with the sample's own draws,
    rather than refusing the config: a recipe keeps its augmentation and still gets the batched
    decode and crop (logged once, in one line).
    """
    tail = _after_crop_and_flip(cfg)
    if tail:
        names = [
            k
            for k, on in (
                ("DATA.AUTO_AUGMENT", cfg.DATA.AUTO_AUGMENT),
                ("DATA.RANDOM_ERASING", cfg.DATA.RANDOM_ERASING > 0),
            )
            if on
        ]
        logger.info("DATA.DECODER batched: %s run per sample after the batched crop", " and ".join(names))
    return batched_train_geometry(cfg), v2.Compose(tail) if tail else None


def batched_train_geometry(cfg: CfgNode, size: int | None = None) -> TrainGeometry:
    """The batched resample's crop and flip, to ``size`` (default TRAIN.IM_SIZE): progressive
    resizing's workers draw each epoch's plans with that epoch's (data/progressive.py)."""
    return TrainGeometry(_random_resized_crop(cfg, size), cfg.DATA.HFLIP_PROB)


def batched_eval_geometry(cfg: CfgNode) -> EvalGeometry | None:
    """Evaluation's resize and centre crop as one batched resample, or None where it cannot: an
    interpolation other than bilinear (a timm model's bicubic), which then runs per sample."""
    p = eval_preprocessing(cfg)
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


def build_normalize(cfg: CfgNode) -> Normalize:
    """uint8 pixels (one image or a batch) to float32 normalised by DATA.MEAN / STD (or a
    pretrained timm model's own); the same arithmetic either way, so predict.py's one image and
    evaluation's batch see the same numbers."""
    p = eval_preprocessing(cfg)
    return Normalize(p.mean, p.std)


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


def eval_preprocessing(cfg: CfgNode) -> EvalPreprocessing:
    """Resolve the evaluation keys: TEST.CROP_SIZE (0: TRAIN.IM_SIZE), TEST.IM_SIZE or the crop /
    TEST.CROP_PCT, TEST.INTERPOLATION, DATA.MEAN / STD. A pretrained timm model's own values
    (``timm.data.resolve_data_config``) fill in the keys left at their defaults: CROP_PCT 0,
    INTERPOLATION "", MEAN / STD at the ImageNet defaults."""
    t, d = cfg.TEST, cfg.DATA
    timm_cfg = _timm_data_config(cfg)
    crop = eval_crop_size(cfg)
    crop_pct = t.CROP_PCT or timm_cfg.get("crop_pct", 0.0)
    defaults = get_cfg_defaults().DATA
    explicit = list(d.MEAN) != list(defaults.MEAN) or list(d.STD) != list(defaults.STD)
    return EvalPreprocessing(
        resize=math.floor(crop / crop_pct) if crop_pct else t.IM_SIZE,  # timm's rounding
        crop=crop,
        interpolation=t.INTERPOLATION or timm_cfg.get("interpolation", "bilinear"),
        mean=tuple(d.MEAN if explicit or not timm_cfg else timm_cfg["mean"]),
        std=tuple(d.STD if explicit or not timm_cfg else timm_cfg["std"]),
    )


def checkpoint_preprocessing(state: dict) -> EvalPreprocessing:
    """The preprocessing a checkpoint's run validated with: stored beside its weights, or, in a
    checkpoint written before it was stored, resolved from its config as validation resolved it."""
    if state.get("preprocessing"):
        return EvalPreprocessing.from_dict(state["preprocessing"])
    cfg = get_cfg_defaults()
    saved = CfgNode.load_cfg(state["cfg"]) if state.get("cfg") else CfgNode()
    for section in ("MODEL", "TRAIN", "TEST", "DATA"):  # key by key: an older config may lack some
        for key, value in saved.get(section, {}).items():
            if key in cfg[section] and not isinstance(value, dict):
                cfg[section][key] = value
    return eval_preprocessing(cfg)


def _timm_data_config(cfg: CfgNode) -> dict:
    if cfg.MODEL.DUMMY_INPUT:
        return {}
    from distribuuuu.models import timm_pretrained_cfg  # models import torchvision's zoo: only when needed

    m = cfg.MODEL
    return timm_pretrained_cfg(m.ARCH, m.PRETRAINED_WEIGHTS or ("DEFAULT" if m.PRETRAINED else None)) or {}


def build_val_transform(cfg: CfgNode, normalize: bool = True) -> Callable:
    """Resize (shorter side) + CenterCrop [+ normalise], as ``eval_preprocessing`` resolves them."""
    return build_eval_transform(eval_preprocessing(cfg), cfg.DATA.DECODER, normalize)


def build_eval_transform(p: EvalPreprocessing, decoder: str = "auto", normalize: bool = True) -> Callable:
    """The transform of ``p`` (validation's, or a checkpoint's stored one for predict and export)."""
    steps = [
        DraftDecode(p.resize) if decoder == "draft" else v2.ToImage(),
        v2.Resize(p.resize, interpolation=v2.InterpolationMode[p.interpolation.upper()], antialias=True),
        v2.CenterCrop(p.crop),
    ]
    return v2.Compose(steps + [Normalize(p.mean, p.std)] if normalize else steps)


def build_batch_mixer(cfg: CfgNode) -> Callable | None:
    """Return mixup/cutmix applied to a batch with probability MIX_PROB, or None if disabled.

    The mixer maps (images, int targets) to (images, soft targets that sum to 1); under MODEL.TASK
    multilabel, (images, multi-hot targets) to (images, the mixed multi-hot targets).
    """
    d, multilabel = cfg.DATA, cfg.MODEL.TASK == "multilabel"
    # torchvision's MixUp and CutMix take class indices only. A multi-label batch of n is handed to
    # them labelled 0..n-1 (at most TRAIN.BATCH_SIZE "classes"): the soft targets they return are
    # then the n x n mixing weights of their very draws, and those weights times the multi-hot
    # rows are the mixed multi-hot targets.
    num_classes = cfg.TRAIN.BATCH_SIZE if multilabel else cfg.MODEL.NUM_CLASSES
    choices, weights = [], []
    if d.MIXUP_ALPHA > 0:
        choices.append(v2.MixUp(alpha=d.MIXUP_ALPHA, num_classes=num_classes))
        weights.append(1.0 - d.MIX_SWITCH_PROB if d.CUTMIX_ALPHA > 0 else 1.0)
    if d.CUTMIX_ALPHA > 0:
        choices.append(v2.CutMix(alpha=d.CUTMIX_ALPHA, num_classes=num_classes))
        weights.append(d.MIX_SWITCH_PROB if d.MIXUP_ALPHA > 0 else 1.0)
    if not choices:
        return None
    mix = v2.RandomChoice(choices, p=weights)

    def mixer(images: torch.Tensor, targets: torch.Tensor):
        # The coin is drawn on the CPU generator: no device sync, and saved in checkpoints.
        if d.MIX_PROB < 1.0 and torch.rand(()).item() >= d.MIX_PROB:
            return images, targets.to(images.dtype) if multilabel else one_hot(targets, num_classes).to(images.dtype)
        if multilabel:
            n = len(images)
            images, weights = mix(images, torch.arange(n, device=images.device))
            return images, weights[:, :n] @ targets.to(weights.dtype)
        return mix(images, targets)

    return mixer
