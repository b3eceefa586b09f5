"""DATA.MAX_IMAGE_PIXELS: an encoded image is opened (its header read, nothing decoded) and refused
when it declares more pixels than the limit, before any decoder allocates them.

A 3 KB JPEG whose frame header says 20000x20000 decodes to 1.2 GB (65535x65535: 12.9 GB, per image
and worker), so every decoder (PIL, draft, torchvision, TorchCodec, the batched decoders) opens
the image here first. PIL parses the header; its size is known before anything is decoded.
"""

from __future__ import annotations

import io

from PIL import Image, JpegImagePlugin, PngImagePlugin, UnidentifiedImageError

from distribuuuu.data.errors import BadImageError

# PIL's own default (Image.MAX_IMAGE_PIXELS, 1024**3 // 4 // 3: 256 MB of RGBA over 3), where PIL
# starts to warn; config/defaults.py's DATA.MAX_IMAGE_PIXELS has the same default.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

# The formats whose PIL parser is called directly, by their first bytes; any other goes through
# Image.open. Image.open runs PIL's own check of Image.MAX_IMAGE_PIXELS before it returns: it warns
# above it and refuses at twice it, in words that name neither the file nor DATA.MAX_IMAGE_PIXELS,
# and it would refuse what a larger DATA.MAX_IMAGE_PIXELS allows. The parsers are what Image.open
# calls for these formats (JPEG's multi-picture variant, MPO, is read as its first picture, the one
# Image.open decodes), so our check below is the one that speaks, exact at the limit. Setting PIL's
# module-wide limit instead would change it for everything else in the process.
_PARSERS = (
    (b"\xff\xd8\xff", JpegImagePlugin.JpegImageFile),
    (b"\x89PNG\r\n\x1a\n", PngImagePlugin.PngImageFile),
)


class ImageTooLargeError(BadImageError):
    """An image declares more pixels than DATA.MAX_IMAGE_PIXELS; a BadImageError, so DATA.BAD_IMAGE
    skip skips and counts it like any unreadable image."""


def open_image(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """``data`` opened by PIL, its header read and nothing decoded; ImageTooLargeError when it declares
    more than ``max_pixels`` pixels (0: no limit), BadImageError naming ``name`` when it is no image."""
    try:
        image = _open(data)
    except UnidentifiedImageError:
        # PIL's own words name the buffer ("<_io.BytesIO object at 0x...>"), not the file
        raise BadImageError(
            f"unreadable image {name}: not an image PIL can identify (it starts {data[:8]!r})"
        ) from None
    except Exception as e:
        raise BadImageError(f"unreadable image {name}: {e}") from None
    check_size(*image.size, name, max_pixels)
    return image


def check_size(width: int, height: int, name: str, max_pixels: int) -> None:
    """Raise ImageTooLargeError naming ``name`` when width x height exceeds ``max_pixels`` (0: no limit)."""
    pixels = width * height
    if max_pixels and pixels > max_pixels:
        raise ImageTooLargeError(
            f"image too large: {name} declares {width}x{height} pixels ({pixels} > DATA.MAX_IMAGE_PIXELS {max_pixels})"
        )


def _open(data: bytes) -> Image.Image:
    parser = next((parser for magic, parser in _PARSERS if data.startswith(magic)), None)
    return parser(io.BytesIO(data)) if parser is not None else Image.open(io.BytesIO(data))
