"""DATA.DECODER batched's JPEG decode on the device: one call for a batch's JPEGs, halved on a failure,
the CPU for a file the device cannot read, and off only when the device decoder is missing.

The workers already send the CPU's way, decoded, every file whose header shows nvJPEG cannot take
it (a CMYK JPEG, a PNG named .JPEG: ``jpeg.takes_on_device``), so a batch's one call normally
succeeds. When it fails all the same, the batch is halved and each half tried again, down to the
files that fail alone: a corrupt file costs about 2 log2(B) calls, not B, and the rest of the
batch stays batched. Out of device memory, halving is the retry at a smaller chunk; one image out
of memory alone is a DeviceMemoryError, in one line. A file that fails alone for another reason is
decoded on the CPU (counted in ``decode_stats.cpu_fallback_images``, warned about once), or named
as bad. The device decoder is given up for the rest of the run only when the error says it is
missing (``jpeg.device_decoder_missing``: a torchvision built without nvJPEG, nvJPEG failing to
start), never for an OOM or a CUDA error, which a later batch may not meet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torchvision.transforms.v2.functional import to_image

from distribuuuu.data import jpeg
from distribuuuu.data.encoded import decode_image_bytes
from distribuuuu.data.errors import BadImageError, DeviceMemoryError

logger = logging.getLogger("distribuuuu.data")


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


def first_line(error: BaseException) -> str:
    """The error's first line (its type's name when it has no message)."""
    return (str(error).splitlines() or [type(error).__name__])[0]


class _DecoderMissing(Exception):
    """The device decoder is not there: every call would fail."""


class DeviceJpegDecoder:
    """Decode JPEGs on ``device`` with ``decode_jpegs(list of encoded tensors, device)`` (jpeg.decode_jpegs),
    one call a batch, as the module says; ``works`` turns False when the decoder is missing."""

    def __init__(self, device: torch.device, skip_bad: bool, max_pixels: int, decode_jpegs: Callable | None = None):
        self.device, self.skip_bad, self.max_pixels = device, skip_bad, max_pixels
        self.decode_jpegs = decode_jpegs or jpeg.decode_jpegs
        # The last device failure's first line, not the exception: its traceback would hold the
        # prefetch thread's frames, and with them the DataLoader iterator and a batch's tensors.
        self.works, self.last_failure = True, ""

    def __call__(self, data: list[torch.Tensor], paths: list[str]) -> list[torch.Tensor | None]:
        """Each JPEG's uint8 RGB (3, H, W) pixels on the device (``None`` for a skipped bad file)."""
        decoded = [None] * len(data)
        if data and self.works:
            try:
                decoded = self._halving(data, paths)
            except _DecoderMissing:
                self._give_up()
        images = [image if image is not None else self._on_cpu(d, p) for image, d, p in zip(decoded, data, paths)]
        on_cpu = [p for image, done, p in zip(decoded, images, paths) if image is None and done is not None]
        if on_cpu and self.works:  # a file it cannot read (a PNG named .jpg, say): that file alone
            _warn_once("image", f"{on_cpu[0]}: not decoded on {self.device}, decoded on the CPU")
        return images

    def _halving(self, data: list[torch.Tensor], paths: list[str]) -> list[torch.Tensor | None]:
        """``data`` decoded in one call, or else its halves, each the same way; None where one alone fails."""
        try:
            decoded = self._decode(data)
        except RuntimeError as e:  # torch.OutOfMemoryError among them
            self.last_failure = first_line(e)
            if jpeg.device_decoder_missing(e):
                raise _DecoderMissing from None
            if len(data) > 1:
                half = len(data) // 2
                return self._halving(data[:half], paths[:half]) + self._halving(data[half:], paths[half:])
            if jpeg.out_of_memory(e):
                raise DeviceMemoryError(
                    f"the device ran out of memory decoding {paths[0]} alone ({self.last_failure}); "
                    "lower TRAIN.BATCH_SIZE or DATA.MAX_IMAGE_PIXELS, or free memory beside training"
                ) from None
            return [None]
        decode_stats.gpu_images += len(decoded)
        return decoded

    def _decode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        wait_for_queued_kernels(self.device)
        return self.decode_jpegs(data, self.device)

    def _give_up(self) -> None:
        self.works = False
        _warn_once(
            "missing",
            f"the batched JPEG decoder on {self.device} is missing ({self.last_failure}): "
            "JPEGs are decoded on the CPU from now on (counted in decode_stats.cpu_fallback_images)",
        )

    def _on_cpu(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        """A JPEG the device decoder failed on, decoded on the CPU by its format, as "auto" does."""
        try:
            decoded = decode_image_bytes(data.numpy().tobytes(), path, "auto", self.max_pixels)
            image = to_image(decoded).as_subclass(torch.Tensor)
        except BadImageError:
            if self.skip_bad:
                return None
            raise
        decode_stats.cpu_fallback_images += 1
        return image.to(self.device)


def wait_for_queued_kernels(device: torch.device) -> None:
    """Block the host until ``device``'s current stream has run what was queued on it (CUDA only).

    nvJPEG's hardware decoder does not wait for the caller's stream: its outputs are allocated on
    that stream, from blocks the caching allocator may have just reclaimed from tensors that queued
    kernels still read (activations, gradients freed by zero_grad), and it can write them before
    those kernels run. torchvision's decoder does not guard against it (pytorch/vision#9606);
    TorchCodec synchronises here too (pytorch/torchcodec#1634), and no event can make a decoder's
    internal stream wait. One host sync per call, at the seam where the decoder takes over.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
