"""Which library decodes JPEGs: TorchCodec where installed, else torchvision.io while it has decoders.

torchvision 0.29 deprecated its image decoders ("will be removed") in favour of TorchCodec, whose
image decoders need no FFmpeg (``pip install torchcodec``, or distribuuuu's ``[codec]`` extra).
Both wrap libjpeg-turbo on the CPU and nvJPEG on CUDA; with neither, DATA.DECODER "auto" decodes
JPEGs with PIL (datasets.py) and "batched" is a config error. The library is looked up at each
call, not at import, so a test can take one away.
"""

from __future__ import annotations

import functools

import torch
import torchvision


@functools.cache
def _torchcodec_decoders():
    try:
        from torchcodec import decoders
    except (ImportError, OSError, RuntimeError):  # missing, or its native library does not load
        return None
    return decoders


def jpeg_library() -> str | None:
    """``"torchcodec"``, ``"torchvision"`` or None: the library that decode_jpegs uses."""
    if _torchcodec_decoders() is not None:
        return "torchcodec"
    if hasattr(torchvision.io, "decode_jpeg"):
        return "torchvision"
    return None


def decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode encoded JPEGs (1-D uint8 CPU tensors) to uint8 RGB (3, H, W) on ``device``, in one call:
    nvJPEG's batched decoder on CUDA. Raises RuntimeError for a file it cannot decode."""
    library = jpeg_library()
    if library == "torchcodec":
        return _torchcodec_decoders().decode_jpeg(list(data), mode="RGB", device=device)
    if library == "torchvision":
        return torchvision.io.decode_jpeg(list(data), mode=torchvision.io.ImageReadMode.RGB, device=device)
    raise RuntimeError("no JPEG decoder: install torchcodec (torchvision's decoders are gone from this release)")


def decode_jpeg(data: torch.Tensor) -> torch.Tensor:
    """Decode one encoded JPEG on the CPU to uint8 RGB (3, H, W)."""
    return decode_jpegs([data], torch.device("cpu"))[0]


# What nvJPEG decodes (torchvision's and TorchCodec's CUDA decoders): baseline and progressive JPEGs
# of one (grey) or three (YCbCr) components. A CMYK or YCCK JPEG (PIL's mode "CMYK"), or another
# format behind a .jpg name, fails the whole batched call ("Unknown chroma subsampling", "Failed to
# get image info").
DEVICE_MODES = ("L", "RGB")

# Words of the errors that say the device decoder is not there at all (torchvision without nvJPEG,
# nvJPEG not starting, no decoder library): every call would fail the same way.
_MISSING = ("not compiled with nvjpeg", "failed to initialize nvjpeg", "nvjpeggetproperty failed", "no jpeg decoder")


def takes_on_device(header) -> bool:
    """Whether nvJPEG decodes the image whose header PIL read (``image_size.open_image``)."""
    return header.format == "JPEG" and header.mode in DEVICE_MODES


def device_decoder_missing(error: BaseException) -> bool:
    """Whether a device decode's ``error`` says the decoder is missing, not that this call failed."""
    message = str(error).lower()
    return any(words in message for words in _MISSING)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device out of memory (the stable ABI of torchvision's decoder raises
    a plain RuntimeError with the allocator's words)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()
