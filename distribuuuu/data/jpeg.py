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
