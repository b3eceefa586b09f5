"""DATA.DECODER "batched": JPEGs decoded a batch at a time, on the training device.

DataLoader workers only read each JPEG's bytes (other formats they decode as "auto" does). The
training process then decodes the whole batch's JPEGs with one ``decode_jpeg`` call (TorchCodec's,
else torchvision's: data/jpeg.py) on its own device (nvJPEG's batched decoder on CUDA, after a
stream sync; libjpeg-turbo on CPU) and applies the per-sample transforms there. Each sample's
augmentation is seeded from (RNG_SEED, epoch, index), exactly as SeededTransformDataset does in
the workers, so a batch is the same whichever path or number of workers made it, and a mid-epoch
resume stays exact.

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

from distribuuuu.data import jpeg
from distribuuuu.data.datasets import CheckedImageFolder, readable, sample_seed, seeded_cpu_rng
from distribuuuu.data.encoded import JPEG_SUFFIXES, EncodedSamples, decode_image_bytes
from distribuuuu.data.errors import BadImageError

logger = logging.getLogger("distribuuuu.data")


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
        targets=torch.utils.data.default_collate([s.target for s in kept]),  # class indices, or multi-hot rows
        seeds=[s.seed for s in kept],
        paths=[s.path for s in kept],
        dropped=len(batch) - len(kept),
    )


@dataclass
class DecodeStats:
    """What this process's batched decoders did: ``gpu_images`` were decoded by the device's batched
    decoder (nvJPEG on CUDA; libjpeg-turbo when the device is the CPU), ``cpu_fallback_images`` by
    the CPU after the device decoder failed on them. tools/gpu_check.py reads them."""

    gpu_images: int = 0
    cpu_fallback_images: int = 0

    def reset(self) -> None:
        self.gpu_images = self.cpu_fallback_images = 0


decode_stats = DecodeStats()
_warned: set[str] = set()  # which fallbacks this process has warned about: one warning each, not one per batch


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        logger.warning(message)


def _is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() > 2 and data[0].item() == 0xFF and data[1].item() == 0xD8  # the SOI marker


def wait_for_queued_kernels(device: torch.device) -> None:
    """Block the host until ``device``'s current stream has run what was queued on it (CUDA only).

    nvJPEG's hardware decoder does not wait for the caller's stream: its outputs are allocated on
    that stream, from blocks the caching allocator may have just reclaimed from tensors that queued
    kernels still read (activations, gradients freed by zero_grad), and it can write them before
    those kernels run. torchvision's decoder does not guard against it (pytorch/vision#9606);
    TorchCodec synchronises here too (pytorch/torchcodec#1634), and no event can make a decoder's
    internal stream wait. One host sync per batch, at the seam where the decoder takes over.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class BatchDecoder:
    """Training-process side: decode a batch's JPEGs in one call on ``device``, then transform.

    Returns ``(images, targets, dropped)`` like the per-sample loaders, images on ``device``.
    ``decode_jpegs(list of encoded tensors, device) -> list of (3, H, W) uint8`` is the device
    decoder (jpeg.decode_jpegs: TorchCodec or torchvision). When the batched call fails, the JPEGs
    are decoded one at a time on the device; those that fail there are decoded on the CPU, by
    format (a PNG named .jpg), or named as bad (with ``skip_bad``, dropped and counted). When the
    device decoded none of them but the CPU did, the device decoder is broken or missing (a
    torchvision built without nvJPEG, nvJPEG failing to start): it is not tried again, and the
    fallback is warned about once per process and counted in ``decode_stats``.
    """

    def __init__(self, transform: Callable, device: torch.device, skip_bad: bool = False, decode_jpegs=None):
        self.transform, self.device, self.skip_bad = transform, device, skip_bad
        self.decode_jpegs = decode_jpegs or jpeg.decode_jpegs
        self.device_decoder_works, self.last_error = True, None

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
        tried_device = self.device_decoder_works
        decoded = self._on_device([batch.data(i) for i in jpegs]) if tried_device else [None] * len(jpegs)
        for i, image in zip(jpegs, decoded):
            pixels[i] = image if image is not None else self._on_cpu(batch.data(i), batch.paths[i])
        on_cpu = [i for i, image in zip(jpegs, decoded) if image is None and pixels[i] is not None]
        device_read_none = all(image is None for image in decoded)
        if tried_device and device_read_none and any(_is_jpeg(batch.data(i)) for i in on_cpu):
            self._give_up_device_decoder()  # it read none of the batch's JPEGs, the CPU read real ones
        elif tried_device and on_cpu:  # a file it cannot read (a PNG named .jpg, say): that file alone
            _warn_once("image", f"{batch.paths[on_cpu[0]]}: not decoded on {self.device}, decoded on the CPU")
        return pixels

    def _on_device(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The JPEGs decoded on the device, in one call; ``None`` where one alone fails there too."""
        if not data:
            return []
        try:
            decoded = self._decode_on_device(data)
        except RuntimeError as e:
            self.last_error = e
            decoded = [self._try_one_on_device(d) for d in data]
        decode_stats.gpu_images += sum(image is not None for image in decoded)
        return decoded

    def _decode_on_device(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        wait_for_queued_kernels(self.device)
        return self.decode_jpegs(data, self.device)

    def _try_one_on_device(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return self._decode_on_device([data])[0]
        except RuntimeError as e:
            self.last_error = e
            return None

    def _give_up_device_decoder(self) -> None:
        self.device_decoder_works = False
        _warn_once(
            "broken",
            f"the batched JPEG decoder on {self.device} failed ({str(self.last_error).splitlines()[0]}): "
            "JPEGs are decoded on the CPU from now on (counted in decode_stats.cpu_fallback_images)",
        )

    def _on_cpu(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        """A JPEG the device decoder failed on, decoded on the CPU by its format, as "auto" does."""
        try:
            image = to_image(decode_image_bytes(data.numpy().tobytes(), path, "auto")).as_subclass(torch.Tensor)
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        decode_stats.cpu_fallback_images += 1
        return image.to(self.device)
