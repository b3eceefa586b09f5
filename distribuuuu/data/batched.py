"""DATA.DECODER "batched": JPEGs decoded a batch at a time, on the training device.

DataLoader workers only read each JPEG's bytes (other formats they decode as "auto" does). The
training process then decodes the whole batch's JPEGs with one ``torchvision.io.decode_jpeg``
call on its own device (nvJPEG's batched decoder on CUDA, libjpeg-turbo on CPU) and applies the
per-sample transforms there. Each sample's augmentation is seeded from (RNG_SEED, epoch, index),
exactly as SeededTransformDataset does in the workers, so a batch is the same whichever path or
number of workers made it, and a mid-epoch resume stays exact.

PyTorch's DataLoader has no batch-level decode step to plug into, hence this module: a dataset
of encoded samples, a collate function that packs a batch of them into one buffer, and the
decoder that loader.DeviceLoader calls on each batch as it arrives.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torchvision
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import ImageReadMode
from torchvision.transforms.v2.functional import to_image

from distribuuuu.data.datasets import (
    JPEG_SUFFIXES,
    BadImageError,
    CheckedImageFolder,
    EncodedSamples,
    decode_image_bytes,
    readable,
    sample_seed,
    seeded_cpu_rng,
)


class EncodedSample(NamedTuple):
    """One sample as a worker hands it over: JPEG bytes (``encoded``) or decoded uint8 pixels."""

    data: torch.Tensor
    encoded: bool
    target: int
    seed: int
    path: str


class EncodedImageDataset(Dataset):
    """Worker side: read a JPEG's bytes, decode any other image as "auto" would.

    Keys are ``(epoch, index)`` pairs, as for SeededTransformDataset. With ``skip_bad`` an
    unreadable file yields ``None``, which the collate function drops and counts.
    """

    def __init__(self, base: CheckedImageFolder | EncodedSamples, seed: int, skip_bad: bool = False):
        self.base, self.seed, self.skip_bad = base, seed, skip_bad

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key) -> EncodedSample | None:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        try:
            raw, name, target = self.base.encoded(index)  # a file's or a packed sample's bytes
            if name.lower().endswith(JPEG_SUFFIXES):
                data, encoded = torch.frombuffer(bytearray(raw), dtype=torch.uint8), True
            else:
                data, encoded = to_image(decode_image_bytes(raw, name, "auto")).as_subclass(torch.Tensor), False
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        return EncodedSample(data, encoded, target, sample_seed(self.seed, epoch, index), name)


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

    def __len__(self) -> int:
        return len(self.paths)

    def data(self, i: int) -> torch.Tensor:
        flat = self.buffer[self.offsets[i] : self.offsets[i + 1]]
        return flat if self.shapes[i] is None else flat.view(self.shapes[i])

    def pin_memory(self) -> EncodedBatch:
        # DataLoader(pin_memory=True) calls this: decoded pixels and targets then reach the GPU by
        # asynchronous copies, and nvJPEG reads the JPEG bytes from pinned memory.
        self.buffer, self.targets = self.buffer.pin_memory(), self.targets.pin_memory()
        return self


def collate_encoded(batch: list[EncodedSample | None]) -> EncodedBatch:
    """Concatenate the samples' bytes or pixels into one buffer; drop and count ``None``."""
    kept = readable(batch)
    sizes = [s.data.numel() for s in kept]
    return EncodedBatch(
        buffer=torch.cat([s.data.reshape(-1) for s in kept]),
        offsets=[0, *itertools.accumulate(sizes)],
        shapes=[None if s.encoded else tuple(s.data.shape) for s in kept],
        targets=torch.tensor([s.target for s in kept]),
        seeds=[s.seed for s in kept],
        paths=[s.path for s in kept],
        dropped=len(batch) - len(kept),
    )


class BatchDecoder:
    """Training-process side: decode a batch's JPEGs in one call on ``device``, then transform.

    Returns ``(images, targets, dropped)`` like the per-sample loaders, images on ``device``.
    When the batched decode fails, the JPEGs are decoded one at a time to name the bad file (or,
    with ``skip_bad``, drop and count it); a file named .jpg that is not a JPEG is decoded by
    format, as "auto" would.
    """

    def __init__(self, transform: Callable, device: torch.device, skip_bad: bool = False):
        self.transform, self.device, self.skip_bad = transform, device, skip_bad

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        pixels = self.decode(batch)
        kept = [i for i, p in enumerate(pixels) if p is not None]
        if not kept:
            raise BadImageError(f"every image of a batch of {len(batch) + batch.dropped} was unreadable")
        images = []
        for i in kept:
            with seeded_cpu_rng(batch.seeds[i]):
                images.append(self.transform(tv_tensors.Image(pixels[i])))
        targets = batch.targets if len(kept) == len(batch) else batch.targets[kept]
        return torch.stack(images), targets, batch.dropped + len(batch) - len(kept)

    def decode(self, batch: EncodedBatch) -> list[torch.Tensor | None]:
        """Each sample's uint8 RGB pixels on the device (``None`` for a skipped bad file)."""
        jpegs = [i for i, shape in enumerate(batch.shapes) if shape is None]
        pixels = [
            None if s is None else batch.data(i).to(self.device, non_blocking=True) for i, s in enumerate(batch.shapes)
        ]
        if not jpegs:
            return pixels
        try:
            decoded = torchvision.io.decode_jpeg(
                [batch.data(i) for i in jpegs], mode=ImageReadMode.RGB, device=self.device
            )
        except RuntimeError:
            decoded = [self._decode_one(batch.data(i), batch.paths[i]) for i in jpegs]
        for i, image in zip(jpegs, decoded):
            pixels[i] = image
        return pixels

    def _decode_one(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        try:
            return torchvision.io.decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass
        try:  # not a JPEG after all (a PNG named .jpg, say): decode it by its format, on the CPU
            return torchvision.io.decode_image(data, mode=ImageReadMode.RGB).to(self.device)
        except RuntimeError as e:
            if self.skip_bad:
                return None
            raise BadImageError(f"unreadable image {path}: {e}") from None
