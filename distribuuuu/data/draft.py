"""DATA.DECODER "draft": decode a JPEG at a reduced DCT scale where the crop allows.

libjpeg can decode at 1/2, 1/4 or 1/8 scale by dropping DCT coefficients, which costs far less
than a full decode (PIL exposes it as ``Image.draft``). The decoder hands the transforms a JPEG
that is opened (header read, size known) but not decoded. Training: RandomResizedCrop samples its
crop from the full-size image with the very RNG draws it makes otherwise, then the image is
decoded at the largest reduction that still leaves the crop at least the output size, and the
crop (scaled) is resized to the output. Evaluation: the image is decoded at the largest reduction
that keeps its shorter side at least the resize target. So the geometry of every crop and the
random stream are those of the full decode; only the pixels differ slightly (DCT scaling is a
different low-pass filter than the antialiased resize). Written here because neither torchvision
nor PIL offers a crop-aware reduced decode.
"""

from __future__ import annotations

from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from distribuuuu.data.errors import BadImageError

REDUCTIONS = (8, 4, 2)  # libjpeg's DCT scales below 1


def is_lazy_jpeg(img) -> bool:
    return isinstance(img, Image.Image) and img.format == "JPEG" and getattr(img, "_im", None) is None


def decode_reduced(img: Image.Image, min_side: float, target: int) -> tuple[Image.Image, float]:
    """Decode a lazy JPEG at the largest reduction r with ``min_side / r >= target``; (RGB image, r)."""
    width, height = img.size
    r = next((r for r in REDUCTIONS if min_side / r >= target), 1)
    try:
        if r > 1:
            # PIL picks the scale from original // requested: floor division, so r itself is picked.
            img.draft("RGB", (width // r, height // r))
        img.load()
        return img.convert("RGB"), width / img.size[0]
    except Exception as e:
        raise BadImageError(f"unreadable image {getattr(img, 'source_name', '?')}: {e}") from None


class DraftRandomResizedCrop(v2.RandomResizedCrop):
    """RandomResizedCrop that decodes a lazy JPEG at a reduced scale when its crop is large enough;
    any other input goes through ToImage and the plain RandomResizedCrop."""

    def forward(self, *inputs):
        img = inputs[0] if len(inputs) == 1 else inputs
        if not is_lazy_jpeg(img):
            return super().forward(F.to_image(img))
        p = self.make_params([img])  # from the full size: the same draws as the full decode
        pixels, r = decode_reduced(img, min(p["height"], p["width"]), min(self.size))
        image = F.to_image(pixels)
        h, w = image.shape[-2:]
        top, left = min(round(p["top"] / r), h - 1), min(round(p["left"] / r), w - 1)
        height, width = max(1, min(round(p["height"] / r), h - top)), max(1, min(round(p["width"] / r), w - left))
        return F.resized_crop(image, top, left, height, width, self.size, self.interpolation, antialias=self.antialias)


class DraftDecode(v2.Transform):
    """Decode a lazy JPEG at the largest reduction keeping its shorter side >= ``min_side``; then ToImage."""

    def __init__(self, min_side: int):
        super().__init__()
        self.min_side = min_side

    def forward(self, *inputs):
        img = inputs[0] if len(inputs) == 1 else inputs
        if is_lazy_jpeg(img):
            img = decode_reduced(img, min(img.size), self.min_side)[0]
        return F.to_image(img)
