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
would be code to keep that cuBLAS already is. Cost: a batch of 256 images of 500x375 (padded to
500x500 where orientations mix) is 768 MB of float32 pixels, two weight tensors of 115 MB, a
344 MB intermediate (as much again where the matmul broadcasts Wx) and the 154 MB output: about
2 GB on the device while a batch is prepared.

A plan is 11 integers per sample: the decoded image's height and width, then for each axis
(y, then x) the crop's start and length, the length the crop is resized to, and the first output
pixel kept (train: the whole resized crop; eval: the centre crop of the resized image), then 1
to flip horizontally.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import to_image

PLAN_FIELDS = 11
_PADDING_WASTE = 1.5  # images share a padded buffer while it holds at most 1.5x their pixels


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


def axis_weights(plans: torch.Tensor, out_len: int, full_len: int, dtype=torch.float32) -> torch.Tensor:
    """(B, out_len, full_len) resampling weights of one axis, from plans' (start, length, resized,
    out_start, flip) columns: aten's _upsample_bilinear2d_aa weights (a triangle filter, its
    support scaled by the downscale factor, normalised per output pixel), zero outside the crop.

    aten also clips each output pixel's taps to a window around its centre; the triangle is zero
    outside that window, so the dense form gives the same weights."""
    start, length, resized, out_start, flip = (plans[:, k].to(dtype) for k in range(5))
    scale = length / resized  # aten's area_pixel_compute_scale, align_corners=False
    support = torch.where(scale >= 1, scale, torch.ones_like(scale))
    center = scale[:, None] * (out_start[:, None] + torch.arange(out_len, device=plans.device, dtype=dtype) + 0.5)
    x = torch.arange(full_len, device=plans.device, dtype=dtype) - start[:, None]  # crop coordinates
    w = (1 - ((x[:, None, :] - center[:, :, None] + 0.5) / support[:, None, None]).abs()).clamp_(min=0)
    w.mul_(((x >= 0) & (x < length[:, None]))[:, None, :])
    w.div_(w.sum(-1, keepdim=True))
    return torch.where(flip[:, None, None] > 0, w.flip(1), w)


def size_groups(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Indices grouped so that padding each group to its largest height and width wastes little.

    One group for a batch of ImageNet-like sizes; a 4000x3000 photo among 500x375 ones gets its own,
    rather than padding 256 images to its size."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i][0] * sizes[i][1])
    groups: list[tuple[list[int], int, int, int]] = []  # (indices, max h, max w, pixels)
    for i in order:
        h, w = sizes[i]
        for g, (indices, gh, gw, pixels) in enumerate(groups):
            padded = max(gh, h) * max(gw, w) * (len(indices) + 1)
            if padded <= _PADDING_WASTE * (pixels + h * w):
                groups[g] = (indices + [i], max(gh, h), max(gw, w), pixels + h * w)
                break
        else:
            groups.append(([i], h, w, h * w))
    return [indices for indices, *_ in groups]


def pad_images(images: list[torch.Tensor], height: int, width: int) -> torch.Tensor:
    """The (3, h, w) images in one zero-padded (B, 3, height, width) float32 buffer: one copy each
    (the decoder hands over one tensor per image), the only launches counted per image."""
    padded = images[0].new_zeros((len(images), 3, height, width), dtype=torch.float32)
    for out, image in zip(padded, images):
        out[:, : image.shape[1], : image.shape[2]].copy_(image)
    return padded


def resample(images: list[torch.Tensor], plans: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """Crop, resize (antialiased bilinear) and flip each (3, H, W) image as its plan says: a float32
    (B, 3, out_h, out_w) batch on the images' device, pixel values in 0..255 unrounded.

    On a GPU, two batched matmuls (``resample_batched``): float32, torchvision's float pixels up to
    rounding (TF32, if a user's script allows it for matmuls, adds about 0.1 of a uint8 level). On a CPU, aten's own kernel image by image (``resample_each``) on the uint8 pixels:
    exactly today's per-sample pixels, at the speed of its vectorised uint8 path. The dense
    matrices cost H x W x out multiply-adds an image where aten's taps cost a few per output pixel:
    a GPU's matmul units absorb that (about 86 GFLOP for 256 images of 500x375 to 224, a
    millisecond or two) and 2 CPU cores do not (7 img/s against 30 for aten's kernel, batch 8).
    tests/test_batched_augment.py checks both against torchvision."""
    if images[0].device.type == "cpu":
        return resample_each(images, plans, out_size)
    return resample_batched(images, plans, out_size)


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


def resample_batched(images: list[torch.Tensor], plans: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """``resample`` as ``Wy @ X @ Wx.T`` over images padded to one buffer per size group."""
    device = images[0].device
    plans = _to_device(plans, device)
    out = torch.empty((len(images), 3, *out_size), device=device)
    for group in size_groups([tuple(image.shape[1:]) for image in images]):
        height, width = (max(images[i].shape[d] for i in group) for d in (1, 2))
        pixels = pad_images([images[i] for i in group], height, width)
        index = _to_device(torch.tensor(group), device) if len(group) < len(images) else slice(None)
        wy = axis_weights(_axis(plans[index], 0), out_size[0], height)
        wx = axis_weights(_axis(plans[index], 1), out_size[1], width)
        out[index] = wy[:, None] @ pixels @ wx[:, None].transpose(-1, -2)
    return out


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory: a copy from pageable memory would make the host wait for the stream.
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values


def _axis(plans: torch.Tensor, axis: int) -> torch.Tensor:
    """One axis's (start, length, resized, out_start, flip) columns: flip only along x."""
    columns = plans[:, 2 + 4 * axis : 6 + 4 * axis]
    flip = plans[:, 10:11] if axis == 1 else torch.zeros_like(plans[:, 10:11])
    return torch.cat([columns, flip], dim=1)
