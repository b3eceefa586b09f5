"""Encoded images: decoding bytes to RGB as DATA.DECODER says, and the base of the readers by row.

Below every dataset format (ImageFolder, packed shards, a saved Hugging Face dataset), so each
reader imports it, and datasets.py, which dispatches over the formats, sits above them all.
"""

from __future__ import annotations

import abc
import contextlib

import numpy as np
import torch
import torchvision
from PIL import Image
from torch.utils.data import Dataset
from torchvision import tv_tensors

from distribuuuu.data.errors import BadImageError
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS, open_image
from distribuuuu.data.index import Samples
from distribuuuu.data.jpeg import decode_jpeg, jpeg_library

# Which files each DATA.DECODER decodes with a tensor decoder (the rest go through PIL). "auto" and
# "batched" take JPEGs there (data/jpeg.py: TorchCodec where installed, else torchvision.io while
# it has decoders; measured faster than PIL, docs/performance.md); once neither is there, "auto"
# is PIL. PIL keeps PNGs, whose 16-bit variants it rescales below; "torchvision" sends JPEG and
# PNG to torchvision.io. "batched" decodes JPEGs a batch at a time (data/batched.py); a single
# image it decodes as "auto".
JPEG_SUFFIXES = (".jpg", ".jpeg")
_TENSOR_SUFFIXES = {
    "pil": (),
    "auto": JPEG_SUFFIXES,
    "batched": JPEG_SUFFIXES,
    "torchvision": JPEG_SUFFIXES + (".png",),
    "draft": (),
}


def load_image(path: str, decoder: str = "auto", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Decode an image file to RGB: a PIL image, or a uint8 tv_tensors.Image via torchvision.io;
    refused (ImageTooLargeError) when its header declares more than ``max_pixels`` pixels (0: no limit)."""
    return decode_image_bytes(read_image_file(path), path, decoder, max_pixels)


def read_image_file(path: str) -> bytes:
    """An image file's bytes; BadImageError naming it when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BadImageError(f"unreadable image {path}: {e}") from None


def decode_image_bytes(data: bytes, name: str, decoder: str = "auto", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Decode an encoded image (``name`` ends in its format and names it in errors) as load_image does."""
    img = open_image(data, name, max_pixels)  # the header alone: a size over the limit is refused here
    try:
        tensor_decoded = name.lower().endswith(_TENSOR_SUFFIXES[decoder])
        if tensor_decoded and decoder == "torchvision":
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return tv_tensors.Image(torchvision.io.decode_image(encoded, mode=torchvision.io.ImageReadMode.RGB))
        if tensor_decoded and jpeg_library():
            with contextlib.suppress(RuntimeError):  # not a JPEG after all (a PNG named .jpg): PIL, by content
                return tv_tensors.Image(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
        if decoder == "draft" and img.format == "JPEG":
            img.source_name = name  # for draft.py's error message
            return img  # decoded later, at a reduced DCT scale where the crop allows (data/draft.py)
        img.load()  # decode now, so a truncated file fails here with its name
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            # PIL's convert("RGB") clips 16-bit values at 255; rescale to 8 bits instead.
            img = Image.fromarray((np.asarray(img, dtype=np.uint32) >> 8).astype(np.uint8))
        return img.convert("RGB")
    except Exception as e:
        raise BadImageError(f"unreadable image {name}: {e}") from None


class EncodedSamples(Dataset, abc.ABC):
    """A dataset of encoded images read by row (packed shards, a saved Hugging Face dataset), shaped
    like ImageFolder: ``samples`` (name, target) held in arrays (data/index.py), ``targets``,
    ``classes``. Class remapping (data/classes.py) replaces ``samples``; each sample keeps its row
    (``samples.row(i)``). Subclasses read a row's bytes with ``read_row(row, name) -> (bytes, name
    for messages ending in the format)``."""

    def __init__(
        self,
        samples: Samples,
        classes: list[str],
        decoder: str,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        self.samples, self.classes, self.decoder, self.max_pixels = samples, classes, decoder, max_pixels
        self.targets = samples.labels

    def __len__(self) -> int:
        return len(self.samples)

    @abc.abstractmethod
    def read_row(self, row: int, name: str) -> tuple[bytes, str]:
        """Row ``row``'s encoded bytes and a name for messages that ends in the image format."""

    def encoded(self, index: int) -> tuple[bytes, str, int]:
        """Sample ``index``'s encoded bytes, a name for messages (ending in its format), its target."""
        name, target = self.samples[index]
        data, where = self.read_row(self.samples.row(index), name)
        return data, where, target

    def __getitem__(self, index: int):
        data, name, target = self.encoded(index)
        return decode_image_bytes(data, name, self.decoder, self.max_pixels), target
