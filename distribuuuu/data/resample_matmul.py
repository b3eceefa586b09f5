"""DATA.DECODER batched's resample on the device: a batch's crops resized, flipped, normalised and
laid out by batched matrix products, in chunks that fit a memory budget (why matrices: resample.py).

**Crops, not images.** Each image's crop is copied into a buffer shared by crops of similar sizes
(``size_groups``: at most 1.5x their pixels), so a 0.08-scale crop of a 12 MP photo costs its own
pixels, not the photo's, and mixed orientations pad only where the crops differ. The buffer's
layout is (n, h, 3, w): the first product is then one plain ``bmm`` over (h, 3w) columns, with no
broadcast of the weights over the channels (``torch.matmul`` copies a broadcast operand).

**A budget.** A group is cut into chunks whose working set (``chunk_bytes``: the crops, both axes'
weights, the intermediates and the output, counted as if all alive at once) fits ``budget`` bytes
(DATA.BATCHED_MEMORY_BUDGET's share of the device); a chunk that still runs out of device memory
is retried in halves, down to one image, which then fails in one line (DeviceMemoryError).

**Precision.** fp16 operands, float32 accumulation and output (``bmm16``), every operand that fp16
does not hold exactly split into two fp16 terms, ``hi + lo * 2**-11`` (``split16``; lo scaled out
of fp16's subnormals): the pixels, integers 0..255, are exact; the weights and the intermediate
keep ~22 bits, so the result stays within float32 rounding of torchvision's, a 2**-20 margin on
top (tests/unit/data/test_batched_augment.py). On tensor cores fp16 runs at ~15x float32's FMA rate (H100
and H200: 990 against 67 dense TFLOP/s), so the five fp16 products cost less than float32's two.
Not TF32: it is switched per process (torch.backends.cuda.matmul), and this thread would switch
it for the model's float32 matmuls too. Not one fp16 or bf16 term: 11 or 8 bits put the result
half a level or two levels of a uint8 pixel off (measured on random crops: 0.24 and 1.9).

**The last step** writes the normalised pixels, ``(x / 255 - mean) / std``, straight into the
batch's layout (channels_last or not): one elementwise pass where normalise and
``contiguous(channels_last)`` were two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distribuuuu.data.errors import DeviceMemoryError

_PADDING_WASTE = 1.5  # crops share a padded buffer while it holds at most 1.5x their pixels
_LO = 2.0**11  # the low fp16 term is scaled by this: fp16 has 11 significant bits


@dataclass(frozen=True)
class OutputFormat:
    """What the last step writes: ``(x / 255 - mean) / std`` per channel in channels_last or not."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels_last: bool = False

    def memory_format(self) -> torch.memory_format:
        """The batch's layout."""
        return torch.channels_last if self.channels_last else torch.contiguous_format


def resample_batched(
    images: list[torch.Tensor],
    plans: torch.Tensor,
    out_size: tuple[int, int],
    output: OutputFormat | None = None,
    budget: int = 0,
) -> torch.Tensor:
    """Crop, resize (antialiased bilinear) and flip each (3, H, W) image as its plan says, in
    chunks of at most ``budget`` bytes (0: no limit): a float32 (B, 3, out_h, out_w) batch on the
    images' device, pixel values 0..255 unrounded, or normalised in ``output``'s layout."""
    device, plans = images[0].device, plans.cpu()  # the host's copy: no sync reads a device tensor
    layout = output.memory_format() if output is not None else torch.contiguous_format
    out = torch.empty((len(images), 3, *out_size), device=device).contiguous(memory_format=layout)
    boxes = plans[:, [3, 7]].tolist()  # each crop's (height, width)
    for group in size_groups([tuple(box) for box in boxes]):
        for chunk in chunks_within(group, boxes, out_size, budget):
            _resample_or_halve(images, plans, chunk, out, output)
    return out


def size_groups(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Indices grouped so that padding each group to its largest height and width wastes little,
    each group's largest first.

    One group for crops of similar sizes; a 4000x3000 crop among 224x224 ones gets its own, rather
    than padding 256 crops to its size."""
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


def chunk_bytes(n: int, height: int, width: int, out_size: tuple[int, int]) -> int:
    """The device memory ``n`` crops padded to height x width take while resampled to ``out_size``,
    every tensor counted as if alive at once: an upper bound of the chunk's working set."""
    out_h, out_w = out_size
    crops = 2 * 3 * height * width  # fp16
    weights = 8 * out_h * height + 8 * out_w * width  # float32 while built, then their two fp16 terms
    columns = (8 + 4 + 4) * out_h * 3 * width  # the first product's two terms, its sum, its fp16 split
    result = (8 + 4 + 4) * out_h * 3 * out_w  # the second product's three terms, the staged chunk
    return n * (crops + weights + columns + result)


def chunks_within(group: list[int], boxes: list[list[int]], out_size: tuple[int, int], budget: int) -> list[list[int]]:
    """``group`` (largest crop first) cut into runs whose ``chunk_bytes`` fit ``budget`` (0: one
    run); a crop over the budget alone is a chunk of its own."""
    chunks: list[list[int]] = []
    for i in group:
        if chunks and (not budget or _fits(chunks[-1] + [i], boxes, out_size, budget)):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return [sorted(chunk) for chunk in chunks]  # in the batch's order: the whole batch is written in place


def _fits(chunk: list[int], boxes: list[list[int]], out_size: tuple[int, int], budget: int) -> bool:
    height, width = (max(boxes[i][d] for i in chunk) for d in (0, 1))
    return chunk_bytes(len(chunk), height, width, out_size) <= budget


def _resample_or_halve(
    images, plans: torch.Tensor, chunk: list[int], out: torch.Tensor, output: OutputFormat | None
) -> None:
    """``resample_chunk`` into ``out``; out of device memory, the two halves one after the other."""
    try:
        resample_chunk(images, plans, chunk, out, output)
        return
    except torch.OutOfMemoryError as e:
        if len(chunk) == 1:
            (height, width), message = plans[chunk[0], [3, 7]].tolist(), (str(e).splitlines() or ["out of memory"])[0]
            raise DeviceMemoryError(
                f"the device ran out of memory resampling one {height}x{width} crop alone ({message}); "
                "lower TRAIN.BATCH_SIZE, or free memory beside training"
            ) from None
    half = len(chunk) // 2
    for part in (chunk[:half], chunk[half:]):
        _resample_or_halve(images, plans, part, out, output)


def resample_chunk(
    images, plans: torch.Tensor, chunk: list[int], out: torch.Tensor, output: OutputFormat | None
) -> None:
    """The chunk's crops (``plans`` on the host) through the products, written into ``out``'s rows ``chunk``."""
    device, (out_h, out_w), host = out.device, out.shape[2:], plans[chunk]
    height, width = host[:, 3].max().item(), host[:, 7].max().item()
    crops = pad_crops([images[i] for i in chunk], host, height, width)
    index, ys, xs = (_to_device(t, device) for t in (torch.tensor(chunk), _axis(host, 0), _axis(host, 1)))
    wy = split16(axis_weights(ys, out_h, height), dim=1)  # (n, 2 out_h, height)
    columns = bmm16(wy, crops.view(len(chunk), height, 3 * width))  # (n, 2 out_h, 3 width)
    del wy, crops
    rows = columns[:, :out_h].add_(columns[:, out_h:], alpha=1 / _LO)  # (n, out_h, 3 width): float32
    del columns
    rows16 = split16(rows.view(len(chunk), out_h * 3, width), dim=1)  # (n, 2 * 3 out_h, width)
    del rows
    wx = split16(axis_weights(xs, out_w, width), dim=1).transpose(1, 2)  # (n, width, 2 out_w)
    high = bmm16(rows16[:, : 3 * out_h], wx)  # (n, 3 out_h, 2 out_w): hi x hi, hi x lo
    high[..., out_w:].add_(bmm16(rows16[:, 3 * out_h :], wx[..., :out_w]))  # + lo x hi
    pixels = high[..., :out_w].add_(high[..., out_w:], alpha=1 / _LO)  # (n, 3 out_h, out_w), rows (h, c)
    _write(pixels.view(len(chunk), out_h, 3, out_w).permute(0, 2, 1, 3), out, index, len(chunk), output)


def pad_crops(images: list[torch.Tensor], plans: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Each image's crop, top-left in one zero-padded fp16 (n, height, 3, width) buffer: one copy
    (and cast) an image, the only launches counted per image. Zeros, not garbage: a zero weight
    times a NaN bit pattern would be NaN."""
    buffer = torch.zeros((len(images), height, 3, width), dtype=torch.float16, device=images[0].device)
    for out, image, plan in zip(buffer, images, plans.tolist()):
        top, crop_h, left, crop_w = plan[2], plan[3], plan[6], plan[7]
        out[:crop_h, :, :crop_w].copy_(image[:, top : top + crop_h, left : left + crop_w].permute(1, 0, 2))
    return buffer


def axis_weights(plans: torch.Tensor, out_len: int, full_len: int) -> torch.Tensor:
    """(B, out_len, full_len) float32 resampling weights of one axis, from plans' (start, length,
    resized, out_start, flip) columns: aten's _upsample_bilinear2d_aa weights (a triangle filter,
    its support scaled by the downscale factor, normalised per output pixel), zero outside the
    crop; a flip reverses the output pixels' order. One (B, out_len, full_len) tensor, changed in place.

    aten also clips each output pixel's taps to a window around its centre; the triangle is zero
    outside that window, so the dense form gives the same weights."""
    start, length, resized, out_start, flip = (plans[:, k].to(torch.float32) for k in range(5))
    scale = length / resized  # aten's area_pixel_compute_scale, align_corners=False
    support = scale.clamp(min=1)
    j = torch.arange(out_len, device=plans.device, dtype=torch.float32)
    j = torch.where(flip[:, None] > 0, out_len - 1 - j, j)  # (B, out_len): the flipped order
    center = scale[:, None] * (out_start[:, None] + j + 0.5)
    x = torch.arange(full_len, device=plans.device, dtype=torch.float32) - start[:, None]  # crop coordinates
    w = x[:, None, :] - center[:, :, None]
    w.add_(0.5).div_(support[:, None, None]).abs_().neg_().add_(1).clamp_(min=0)
    w.mul_(((x >= 0) & (x < length[:, None]))[:, None, :])
    return w.div_(w.sum(-1, keepdim=True))


def split16(values: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 ``values`` as two fp16 terms stacked along ``dim``: ``hi``, then ``(values - hi) * 2**11``;
    ``values`` is used up (changed in place)."""
    size = values.shape[dim]
    terms = torch.empty(
        (*values.shape[:dim], 2 * size, *values.shape[dim + 1 :]), dtype=torch.float16, device=values.device
    )
    high, low = terms.narrow(dim, 0, size), terms.narrow(dim, size, size)
    high.copy_(values)
    low.copy_(values.sub_(high).mul_(_LO))
    return terms


def _write(pixels: torch.Tensor, out: torch.Tensor, index: torch.Tensor, n: int, output: OutputFormat | None) -> None:
    """The chunk's (n, 3, h, w) pixels into ``out`` at ``index``, normalised first with ``output``:
    one elementwise pass into the batch's layout (straight into ``out`` when the chunk is the batch)."""
    whole = n == len(out)
    staged = out if whole else torch.empty_like(out[:n])
    if output is None:
        staged.copy_(pixels)
    else:
        scale, shift = _affine(output, out.device)
        torch.addcmul(shift, pixels, scale, out=staged)
    if not whole:
        out.index_copy_(0, index, staged)


def _affine(output: OutputFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / 255 - mean) / std`` as ``x * scale + shift`` per channel, (1, 3, 1, 1) on ``device``."""
    std, mean = torch.tensor(output.std, dtype=torch.float64), torch.tensor(output.mean, dtype=torch.float64)
    scale, shift = (1 / (255 * std)).float().view(1, -1, 1, 1), (-mean / std).float().view(1, -1, 1, 1)
    return _to_device(scale, device), _to_device(shift, device)


# --- the CUDA seams -----------------------------------------------------------------------------


def bmm16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 ``a @ b`` with float32 accumulation and output: cuBLAS's fp16 GEMM on CUDA. On a CPU the
    same arithmetic (a product of two fp16 values is exact in float32) by float32 ``bmm``."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory: a copy from pageable memory would make the host wait for the stream.
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values


def _axis(plans: torch.Tensor, axis: int) -> torch.Tensor:
    """One axis's (start, length, resized, out_start, flip) columns, relative to the crop (its
    pixels start the padded buffer): start 0; flip only along x."""
    columns = plans[:, 2 + 4 * axis : 6 + 4 * axis].clone()
    columns[:, 0] = 0
    flip = plans[:, 10:11] if axis == 1 else torch.zeros_like(plans[:, 10:11])
    return torch.cat([columns, flip], dim=1)
