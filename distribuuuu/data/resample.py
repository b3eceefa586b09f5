"""DATA.DECODER batched's geometry: crops drawn in the workers, a whole batch resampled at once.

A worker knows an image's size from its header (no decode) and draws its crop and flip there, from
the sample's seed, with torchvision's own RandomResizedCrop / RandomHorizontalFlip drawing:
``TrainGeometry.plan``. The training process then resizes the batch's crops with ``resample``.

Why two matrix products (separable resampling) rather than roi_align, grid_sample or a Triton
kernel: torchvision's ``resized_crop(..., antialias=True)`` is aten's ``_upsample_bilinear2d_aa``, a
separable triangle filter whose support widens with the downscale factor. Written as matrices,
the resize of a crop is ``Wy @ X @ Wx.T`` per channel, with Wy (out_h x H) and Wx (out_w x W) the
same weights, zero outside the crop; a flip is Wx's rows reversed. Over images padded to one
buffer that is two batched matmuls, the same numbers as torchvision up to float rounding, in a
few launches however many images; grid_sample has no antialiasing (aliasing on 0.08-scale
crops), roi_align's adaptive sampling is a box filter (other pixels), and a kernel of our own
would be code to keep that cuBLAS already is. The products, their precision, memory budget and
layout: resample_matmul.py.

A plan is 11 integers per sample: the decoded image's height and width, then for each axis
(y, then x) the crop's start and length, the length the crop is resized to, and the first output
pixel kept (train: the whole resized crop; eval: the centre crop of the resized image), then 1
to flip horizontally.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import to_image

from distribuuuu.data.resample_matmul import OutputFormat, resample_batched

PLAN_FIELDS = 11


def _size_stub(height: int, width: int) -> torch.Tensor:
    # An image of the right size and no pixels (stride 0): what torchvision's query_size reads.
    return to_image(torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, height, width))


class TrainGeometry:
    """RandomResizedCrop(size, scale, ratio) then RandomHorizontalFlip(flip_prob), drawn as today's
    per-sample transforms draw them: the crop's make_params, then the flip's coin, from the global
    CPU generator (seeded per sample by the caller, as datasets.seeded_cpu_rng does)."""

    def __init__(self, crop: v2.RandomResizedCrop, flip_prob: float):
        self.crop, self.flip_prob = crop, flip_prob
        self.out_size = tuple(crop.size)

    def draw(self, height: int, width: int) -> torch.Tensor:
        """Draw one sample's plan from the global CPU generator."""
        box = self.crop.make_params([_size_stub(height, width)])
        # _RandomApplyTransform.forward: the coin is drawn only when the flip is in the transform
        flip = self.flip_prob > 0 and bool(torch.rand(1) < self.flip_prob)
        out_h, out_w = self.out_size
        y = (box["top"], box["height"], out_h, 0)
        x = (box["left"], box["width"], out_w, 0)
        return torch.tensor([height, width, *y, *x, int(flip)], dtype=torch.int64)

    def out_size_of(self, plans: torch.Tensor) -> tuple[int, int]:
        """The output size of a batch of training plans: the length each axis's crop is resized to,
        as the workers drew it (progressive resizing's size of the batch's epoch, not ``out_size``)."""
        return tuple(plans[0, [4, 8]].tolist())


class EvalGeometry:
    """Resize the shorter side to ``resize`` (bilinear, antialiased), centre-crop ``crop``: the
    arithmetic of v2.Resize(int) and v2.CenterCrop (torchvision's private _compute_resized_output_size,
    written out for two lines). No draw: the plan depends on the size alone."""

    def __init__(self, resize: int, crop: int):
        self.resize, self.crop = resize, crop
        self.out_size = (crop, crop)

    def draw(self, height: int, width: int) -> torch.Tensor:
        """The plan of an image of this size."""
        short, long = min(height, width), max(height, width)
        new_long = int(self.resize * long / short)
        new_h, new_w = (new_long, self.resize) if width <= height else (self.resize, new_long)
        top, left = int(round((new_h - self.crop) / 2.0)), int(round((new_w - self.crop) / 2.0))
        return torch.tensor([height, width, 0, height, new_h, top, 0, width, new_w, left, 0], dtype=torch.int64)

    def out_size_of(self, plans: torch.Tensor) -> tuple[int, int]:
        """The centre crop's size, whatever the plans."""
        return self.out_size


def resample(
    images: list[torch.Tensor],
    plans: torch.Tensor,
    out_size: tuple[int, int],
    output: OutputFormat | None = None,
    budget: int = 0,
) -> torch.Tensor:
    """Crop, resize (antialiased bilinear) and flip each (3, H, W) image as its plan says: a float32
    (B, 3, out_h, out_w) batch on the images' device, pixel values in 0..255 unrounded, or
    normalised in ``output``'s layout.

    On a GPU, batched matrix products within ``budget`` bytes (resample_matmul.resample_batched:
    torchvision's float pixels up to float32 rounding). On a CPU, aten's own kernel image by image
    (``resample_each``) on the uint8 pixels: exactly today's per-sample pixels, at the speed of its
    vectorised uint8 path, normalised as the per-sample path does. The dense matrices cost H x W x
    out multiply-adds an image where aten's taps cost a few per output pixel: a GPU's matrix units
    absorb that and 2 CPU cores do not (7 img/s against 30 for aten's kernel, batch 8).
    tests/unit/data/test_batched_augment.py checks both against torchvision."""
    if images[0].device.type != "cpu":
        return resample_batched(images, plans, out_size, output, budget)
    out = resample_each(images, plans, out_size)
    return out if output is None else output_on_cpu(out, output)


def output_on_cpu(pixels: torch.Tensor, output: OutputFormat) -> torch.Tensor:
    """``output`` by transforms.Normalize's own operations: on a CPU the batched path's batches are the
    per-sample path's, bit for bit."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in (output.mean, output.std))
    pixels = pixels.div_(255).sub_(mean).div_(std)
    return pixels.contiguous(memory_format=output.memory_format())


def resample_each(images: list[torch.Tensor], plans: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """``resample`` by aten's antialiased bilinear interpolation of each uint8 crop (rounded, as
    torchvision's per-sample resize of uint8 pixels), returned as float32."""
    out = torch.empty((len(images), 3, *out_size), device=images[0].device)
    for image, plan, pixels in zip(images, plans.tolist(), out):
        _, _, top, crop_h, resized_h, out_top, left, crop_w, resized_w, out_left, flip = plan
        crop = image[None, :, top : top + crop_h, left : left + crop_w]
        resized = torch.nn.functional.interpolate(crop, (resized_h, resized_w), mode="bilinear", antialias=True)
        kept = resized[0, :, out_top : out_top + out_size[0], out_left : out_left + out_size[1]]
        pixels.copy_(kept.flip(-1) if flip else kept)
    return out
