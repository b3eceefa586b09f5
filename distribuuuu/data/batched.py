"""DATA.DECODER "batched": JPEGs decoded and augmented a batch at a time, on the training device.

DataLoader workers only read each JPEG's bytes and its header (refusing one that declares more than
DATA.MAX_IMAGE_PIXELS: data/image_size.py; a JPEG nvJPEG cannot take, such as CMYK, and other
formats they decode as "auto" does), and draw the sample's crop and flip from its seed (RNG_SEED,
epoch, index): resample.py. The training process then decodes the whole batch's JPEGs with one
``decode_jpeg`` call (TorchCodec's, else torchvision's: data/jpeg.py) on its own device (nvJPEG's
batched decoder on CUDA; libjpeg-turbo on CPU; its failures: device_decode.py), crops, resizes,
flips and normalises the batch in one ``resample`` (batched matrix products within a memory
budget: resample_matmul.py), on a thread of its own one batch ahead (prefetch.py). What the batched resample cannot do (an
AUTO_AUGMENT policy, RANDOM_ERASING) runs after it per sample, with the sample's own draws: see
transforms.batched_train_steps. A batch is the same whatever the number of workers, and a
mid-epoch resume stays exact.

With DATA.BATCHED_AUGMENT False the whole per-sample transform runs on the device after the batched
decode, as it did before the batched resample: the same pixels as "auto".

PyTorch's DataLoader has no batch-level decode step to plug into, hence this module: a dataset
of encoded samples, a collate function that packs a batch of them into one buffer, and the
decoder that loader.DeviceLoader calls on each batch as it arrives.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2.functional import to_image

from distribuuuu.data import jpeg, resample
from distribuuuu.data.datasets import CheckedImageFolder, readable, sample_seed, seeded_cpu_rng
from distribuuuu.data.device_decode import DeviceJpegDecoder, decode_stats  # noqa: F401  (decode_stats: gpu_check reads it here)
from distribuuuu.data.encoded import JPEG_SUFFIXES, EncodedSamples, decode_image_bytes
from distribuuuu.data.errors import BadImageError
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS, open_image
from distribuuuu.data.progressive import for_key_epoch

logger = logging.getLogger("distribuuuu.data")


class EncodedSample(NamedTuple):
    """One sample as a worker hands it over: JPEG bytes (``encoded``) or decoded uint8 pixels."""

    data: torch.Tensor
    encoded: bool
    target: int
    seed: int
    path: str
    plan: torch.Tensor | None = None  # the crop and flip drawn for it (resample.py), without a geometry None


class EncodedImageDataset(Dataset):
    """Worker side: read a JPEG's bytes, decode any other image as "auto" would.

    Keys are ``(epoch, index)`` pairs, as for SeededTransformDataset. With a ``geometry``
    (resample.TrainGeometry or EvalGeometry) each sample's plan is drawn here, from the image's
    size (a JPEG's header) under the sample's seed; under progressive resizing ``geometry`` is an
    EpochTransforms of geometries, one per size, and the key's epoch picks one (``rounds_per_epoch``
    as for SeededTransformDataset). With ``skip_bad`` an unreadable file, or one whose header declares
    more than ``max_pixels`` pixels, yields ``None``, which the collate function drops and counts.
    """

    rounds_per_epoch = 1

    def __init__(
        self,
        base: CheckedImageFolder | EncodedSamples,
        seed: int,
        skip_bad: bool = False,
        geometry=None,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        self.base, self.seed, self.skip_bad, self.geometry = base, seed, skip_bad, geometry
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key) -> EncodedSample | None:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        try:
            raw, name, target = self.base.encoded(index)  # a file's or a packed sample's bytes
            # A JPEG's header, read here: the training process decodes only what it lets through,
            # and what nvJPEG cannot take (a CMYK JPEG, a PNG named .jpg) is decoded here instead,
            # so the batch's one device call does not fail over one file.
            header = open_image(raw, name, self.max_pixels) if name.lower().endswith(JPEG_SUFFIXES) else None
            if header is not None and jpeg.takes_on_device(header):
                width, height = header.size
                data, encoded, size = torch.frombuffer(bytearray(raw), dtype=torch.uint8), True, (height, width)
            else:
                decoded = decode_image_bytes(raw, name, "auto", self.max_pixels)
                data, encoded = to_image(decoded).as_subclass(torch.Tensor), False
                size = tuple(data.shape[1:])
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        seed = sample_seed(self.seed, epoch, index)
        plan = None
        if self.geometry is not None:
            with seeded_cpu_rng(seed):
                plan = for_key_epoch(self.geometry, epoch, self.rounds_per_epoch).draw(*size)
        return EncodedSample(data, encoded, target, seed, name, plan)


@dataclass
class EncodedBatch:
    """A batch's samples in one flat uint8 buffer, so a worker hands over one shared-memory block
    rather than one per image (hundreds of them exhaust file descriptors); ``dropped`` counts the
    unreadable files already left out."""

    buffer: torch.Tensor
    offsets: list[int]  # sample i is buffer[offsets[i]:offsets[i + 1]]
    shapes: list[tuple | None]  # None: JPEG bytes; (3, H, W): decoded pixels
    targets: torch.Tensor
    seeds: list[int]
    paths: list[str]
    dropped: int
    plans: torch.Tensor | None = None  # (B, resample.PLAN_FIELDS), with a geometry

    def __len__(self) -> int:
        return len(self.paths)

    def data(self, i: int) -> torch.Tensor:
        flat = self.buffer[self.offsets[i] : self.offsets[i + 1]]
        return flat if self.shapes[i] is None else flat.view(self.shapes[i])

    def pin_memory(self) -> EncodedBatch:
        # DataLoader(pin_memory=True) calls this: decoded pixels and targets then reach the GPU by
        # asynchronous copies, and nvJPEG reads the JPEG bytes from pinned memory.
        self.buffer, self.targets = self.buffer.pin_memory(), self.targets.pin_memory()
        if self.plans is not None:
            self.plans = self.plans.pin_memory()
        return self


def collate_encoded(batch: list[EncodedSample | None]) -> EncodedBatch:
    """Concatenate the samples' bytes or pixels into one buffer; drop and count ``None``."""
    kept = readable(batch)
    sizes = [s.data.numel() for s in kept]
    return EncodedBatch(
        buffer=torch.cat([s.data.reshape(-1) for s in kept]),
        offsets=[0, *itertools.accumulate(sizes)],
        shapes=[None if s.encoded else tuple(s.data.shape) for s in kept],
        targets=torch.utils.data.default_collate([s.target for s in kept]),  # class indices, or multi-hot rows
        seeds=[s.seed for s in kept],
        paths=[s.path for s in kept],
        dropped=len(batch) - len(kept),
        plans=None if kept[0].plan is None else torch.stack([s.plan for s in kept]),
    )


@dataclass
class PreparedBatch:
    """A batch as the prepare thread hands it over: ``images`` normalised float (B, 3, h, w), or,
    while per-sample steps remain, uint8 (a stacked tensor, or a list of decoded images)."""

    images: torch.Tensor | list[torch.Tensor]
    targets: torch.Tensor
    dropped: int
    seeds: list[int]
    sizes: list[tuple[int, int]]  # each kept image's decoded (height, width)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the training stream will read (prefetch.wait_ready)."""
        images = self.images if isinstance(self.images, list) else [self.images]
        return [*images, self.targets]


def _to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    # What today's per-sample resize hands the steps after it: pixels rounded to uint8.
    return pixels.round_().clamp_(0, 255).to(torch.uint8)


class BatchDecoder:
    """Training-process side: decode a batch's JPEGs in one call on ``device``, then augment.

    ``prepare`` (safe on another thread: it draws nothing from the global RNG) decodes, and with a
    ``geometry`` crops, resizes and flips the batch at once (resample.resample, in chunks of at
    most ``memory_budget`` bytes of device memory, 0: no limit) and, when no per-sample step
    follows, normalises it with ``normalize``'s mean and std (channels_last with
    ``channels_last``) in the same last step. ``finish`` (the training thread) runs ``transform`` on each sample under
    its seed: the whole per-sample transform without a geometry, the steps after the crop and
    flip with one (its draws replayed first, so the steps see today's generator stream). Calling
    the decoder does both, returning ``(images, targets, dropped)`` like the per-sample loaders.

    ``decode_jpegs(list of encoded tensors, device) -> list of (3, H, W) uint8`` is the device
    decoder (jpeg.decode_jpegs: TorchCodec or torchvision), called once a batch, halved on a
    failure, off only when missing (device_decode.DeviceJpegDecoder); a file that fails alone is
    decoded on the CPU, by format, or named as bad (with ``skip_bad``, dropped and counted).
    """

    def __init__(
        self,
        transform: Callable | None,
        device: torch.device,
        skip_bad: bool = False,
        decode_jpegs=None,
        geometry=None,
        normalize: Callable | None = None,
        channels_last: bool = False,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        memory_budget: int = 0,
    ):
        self.transform, self.device, self.skip_bad = transform, device, skip_bad
        self.jpegs = DeviceJpegDecoder(device, skip_bad, max_pixels, decode_jpegs)
        self.geometry, self.memory_budget = geometry, memory_budget
        self.output = None  # the batch as the resample hands it over when no per-sample step follows
        if normalize is not None:  # transforms.Normalize: its (C, 1, 1) mean and std
            mean, std = (tuple(v.flatten().tolist()) for v in (normalize.mean, normalize.std))
            self.output = resample.OutputFormat(mean, std, channels_last)

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.finish(self.prepare(batch))

    def prepare(self, batch: EncodedBatch) -> PreparedBatch:
        """Decode the batch, and resample (and normalise) it when there is a geometry."""
        pixels = self.decode(batch)
        kept = [i for i, p in enumerate(pixels) if p is not None and self._size_as_planned(batch, i, p)]
        if not kept:
            raise BadImageError(f"every image of a batch of {len(batch) + batch.dropped} was unreadable")
        targets = batch.targets if len(kept) == len(batch) else batch.targets[kept]
        dropped = batch.dropped + len(batch) - len(kept)
        images = [pixels[i] for i in kept]
        sizes = [tuple(image.shape[1:]) for image in images]
        prepared = PreparedBatch(images, targets, dropped, [batch.seeds[i] for i in kept], sizes)
        if self.geometry is not None:
            plans, output = batch.plans[kept], self.output if self.transform is None else None
            size = self.geometry.out_size_of(plans)
            resampled = resample.resample(images, plans, size, output, self.memory_budget)
            prepared.images = resampled if self.transform is None else _to_uint8(resampled)
        return prepared

    def finish(self, prepared: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run the per-sample steps, each under its sample's seed; ``(images, targets, dropped)``."""
        images = prepared.images
        if self.transform is not None:
            transformed = []
            for image, seed, size in zip(images, prepared.seeds, prepared.sizes):
                with seeded_cpu_rng(seed):
                    if self.geometry is not None:
                        # the crop's and flip's draws, as the workers made them (at any size: the
                        # draws read the scale, the ratio and the image's size, not the output's)
                        self.geometry.draw(*size)
                    transformed.append(self.transform(tv_tensors.Image(image)))
            images = torch.stack(transformed)
        return images, prepared.targets, prepared.dropped

    def _size_as_planned(self, batch: EncodedBatch, i: int, image: torch.Tensor) -> bool:
        """Whether image ``i`` decoded to the size its header gave (and its crop was drawn for)."""
        if batch.plans is None or list(image.shape[1:]) == batch.plans[i, :2].tolist():
            return True
        message = f"unreadable image {batch.paths[i]}: decoded {tuple(image.shape[1:])}, its header says {tuple(batch.plans[i, :2].tolist())}"
        if self.skip_bad:
            logger.warning(message)
            return False
        raise BadImageError(message)

    def decode(self, batch: EncodedBatch) -> list[torch.Tensor | None]:
        """Each sample's uint8 RGB pixels on the device (``None`` for a skipped bad file)."""
        jpegs = [i for i, shape in enumerate(batch.shapes) if shape is None]
        pixels = [
            None if s is None else batch.data(i).to(self.device, non_blocking=True) for i, s in enumerate(batch.shapes)
        ]
        decoded = self.jpegs([batch.data(i) for i in jpegs], [batch.paths[i] for i in jpegs])
        for i, image in zip(jpegs, decoded):
            pixels[i] = image
        return pixels
