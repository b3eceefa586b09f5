"""DATA.DECODER batched's batched resample: crops drawn in the workers as today's per-sample
transforms draw them, pixels of torchvision's antialiased resized_crop + flip (chunked within a
memory budget or not, 12 MP photos and 1x1 images alike, normalised into the batch's layout), the
same batches for any number of workers and from any start, and the prepare thread's hand-over."""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from distribuuuu import cli
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import resample_matmul
from distribuuuu.data.batched import BatchDecoder, EncodedImageDataset
from distribuuuu.data.datasets import seeded_cpu_rng
from distribuuuu.data.errors import DeviceMemoryError
from distribuuuu.data.prefetch import THREAD_NAME
from distribuuuu.data.resample import EvalGeometry, TrainGeometry, resample_each
from distribuuuu.data.resample_matmul import OutputFormat, chunk_bytes, resample_batched, size_groups
from distribuuuu.data.transforms import _after_crop_and_flip, _crop_and_flip
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import batched_memory_budget, build_train_split, build_val_split
from distribuuuu.training.preprocessing import train_augment


def _tolerance(height: int, width: int) -> float:
    """How far the batched resample's pixels may lie from torchvision's float ones, both exact but for rounding.

    Each output sums at most H then W products of pixels <= 255 with non-negative weights summing
    to 1, in float32 (aten's and ours, in another order): at most 255 * 2^-24 per term of the two
    sums, and 3 more for adding up the fp16 terms. The products are of fp16 values, exact in
    float32; each operand fp16 does not hold (both axes' weights, the intermediate) is two fp16
    terms, which hold it to 2^-22 (each term rounds to 2^-11 of what it carries), and the dropped
    lo x lo product is below 2^-22 of the result: 4 x 2^-22 = 2^-20 of at most 255.
    """
    return 255 * (2**-24 * (height + width + 3) + 2**-20)


def _reference(image: torch.Tensor, plan: list[int], out_size, dtype=torch.float32) -> torch.Tensor:
    """torchvision's per-image resized_crop (antialias) + flip, on float pixels: the same filter."""
    top, crop_h, left, crop_w = plan[2], plan[3], plan[6], plan[7]
    out = F.resized_crop(image.to(dtype), top, left, crop_h, crop_w, list(out_size), antialias=True)
    return out.flip(-1) if plan[10] else out


SIZES = [(375, 500), (500, 375), (7, 9), (33, 21), (100, 100), (1, 1), (11, 200)]


@pytest.mark.parametrize("scale_min", [0.005, 0.6])  # crops of a few pixels (upscaled), and large ones
def test_the_batched_resample_is_torchvisions_antialiased_resized_crop_and_flip(scale_min):
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in SIZES]
    geometry = TrainGeometry(v2.RandomResizedCrop(24, scale=(scale_min, 1.0), antialias=True), 0.5)
    with seeded_cpu_rng(1):
        plans = torch.stack([geometry.draw(h, w) for h, w in SIZES])
    assert plans[:, 10].any() and not plans[:, 10].all()  # flipped and not
    assert len(size_groups(SIZES)) > 1  # padded buffers of several sizes
    out = resample_batched(images, plans, (24, 24))  # a GPU's: fp16 products, float32 sums
    on_cpu = resample_each(images, plans, (24, 24))  # a CPU's: aten's uint8 kernel, today's pixels exactly
    for image, plan, pixels, cpu_pixels in zip(images, plans.tolist(), out, on_cpu):
        error = (pixels - _reference(image, plan, (24, 24))).abs().max().item()
        assert error <= _tolerance(*image.shape[1:]), (plan, error)
        # Today's per-sample path resizes uint8 pixels (aten's fixed-point kernel) and rounds: at most
        # half a level from rounding and half from the fixed-point weights.
        uint8 = _reference(image, plan, (24, 24), torch.uint8).float()
        assert (pixels - uint8).abs().max().item() <= 1.0, plan
        assert torch.equal(cpu_pixels, uint8), plan


def test_the_tolerance_catches_a_box_one_pixel_off():
    image = torch.randint(0, 256, (3, 50, 60), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    plan = torch.tensor([[50, 60, 5, 30, 24, 0, 7, 40, 24, 0, 0]])
    shifted = plan.clone()
    shifted[0, 6] += 1  # the crop's left edge one pixel over
    out = resample_batched([image], shifted, (24, 24))[0]
    assert (out - _reference(image, plan[0].tolist(), (24, 24))).abs().max() > 100 * _tolerance(50, 60)


def test_eval_geometry_is_resize_then_center_crop():
    g = torch.Generator().manual_seed(3)
    sizes = [(375, 500), (500, 375), (41, 41), (30, 97)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    geometry = EvalGeometry(36, 32)
    plans = torch.stack([geometry.draw(h, w) for h, w in sizes])
    reference = v2.Compose([v2.Resize(36, antialias=True), v2.CenterCrop(32)])
    for image, pixels, cpu_pixels in zip(
        images, resample_batched(images, plans, (32, 32)), resample_each(images, plans, (32, 32))
    ):
        assert (pixels - reference(image.float())).abs().max() <= _tolerance(*image.shape[1:])
        assert torch.equal(cpu_pixels, reference(image).float())


@pytest.mark.parametrize("hflip", [0.0, 0.5])
def test_the_workers_draws_leave_the_generator_where_the_per_sample_transforms_do(hflip):
    # Same crop, same flip, and the same generator state after them: the steps that follow
    # (auto-augment, erasing) draw what they draw today.
    cfg = load_cfg(None, ["DATA.HFLIP_PROB", str(hflip), "DATA.CROP_SCALE_MIN", "0.08"])
    geometry = TrainGeometry(v2.RandomResizedCrop(32, scale=(0.08, 1.0), antialias=True), hflip)
    per_sample = v2.Compose(_crop_and_flip(train_augment(cfg)))
    for seed, (h, w) in enumerate([(375, 500), (20, 300), (64, 64)]):
        image = (torch.rand(3, h, w) * 255).round().to(torch.uint8)  # decoded pixels: integers
        with seeded_cpu_rng(seed):
            plan = geometry.draw(h, w)
            after_draws = torch.get_rng_state()
        with seeded_cpu_rng(seed):
            expected = per_sample(tv_tensors.Image(image.float()))
            after_transform = torch.get_rng_state()
        assert torch.equal(after_draws, after_transform)
        out = resample_batched([image], plan[None], (32, 32))[0]
        assert (out - expected).abs().max() <= _tolerance(h, w)


# ------------------------------------------------------------------------------------------------
# The memory budget: chunks, 12 MP photos, a chunk out of memory
# ------------------------------------------------------------------------------------------------
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PHOTOS = [(3000, 4000), (4000, 3000), (1, 1), (375, 500), (500, 375), (7, 9)]  # 12 MP in both orientations


def _normalised_reference(image: torch.Tensor, plan: list[int], out_size) -> torch.Tensor:
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (MEAN, STD))
    return (_reference(image, plan, out_size) / 255 - mean) / std


def _photo_batch(seed: int = 4, size: int = 32) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in PHOTOS]
    geometry = TrainGeometry(v2.RandomResizedCrop(size, scale=(0.08, 1.0), antialias=True), 0.5)
    with seeded_cpu_rng(seed):
        plans = torch.stack([geometry.draw(h, w) for h, w in PHOTOS])
    return images, plans


def test_chunked_and_whole_batches_of_12_mp_and_1x1_images_are_torchvisions_pixels_normalised(monkeypatch):
    images, plans = _photo_batch()
    chunks = []
    resample_chunk = resample_matmul.resample_chunk

    def counted(images, plans, chunk, out, output):
        chunks.append(list(chunk))
        return resample_chunk(images, plans, chunk, out, output)

    monkeypatch.setattr(resample_matmul, "resample_chunk", counted)
    output = OutputFormat(MEAN, STD, channels_last=True)
    budget = chunk_bytes(2, 40, 40, (32, 32))  # two crops of 40x40: the small images' crops alone fit
    for limit in (0, budget):
        chunks.clear()
        out = resample_batched(images, plans, (32, 32), output, limit)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert sorted(i for chunk in chunks for i in chunk) == list(range(len(images)))  # each image once
        for image, plan, pixels in zip(images, plans.tolist(), out):
            # the pixel bound, carried through the normalisation (1 / (255 std)), and its own
            # rounding: two float32 operations on values below 3
            bound = _tolerance(*image.shape[1:]) / (255 * min(STD)) + 2 * 3 * 2**-23
            error = (pixels - _normalised_reference(image, plan, (32, 32))).abs().max().item()
            assert error <= bound, (limit, plan, error, bound)
        if limit:
            assert len(chunks) > len(size_groups([tuple(p) for p in plans[:, [3, 7]].tolist()]))
            heights, widths = plans[:, 3].tolist(), plans[:, 7].tolist()
            for chunk in chunks:  # each chunk fits the budget, or is one crop larger than it alone
                height, width = max(heights[i] for i in chunk), max(widths[i] for i in chunk)
                assert len(chunk) == 1 or chunk_bytes(len(chunk), height, width, (32, 32)) <= limit, chunk


def test_the_tolerance_catches_one_fp16_term():
    # The second fp16 term is what keeps the pixels to float32's rounding: without it (fp16 alone,
    # 11 bits) a crop of random pixels lies far outside the bound.
    images, plans = _photo_batch(seed=5, size=224)
    split16 = resample_matmul.split16

    def one_term(values, dim):
        terms = split16(values, dim)
        terms.narrow(dim, terms.shape[dim] // 2, terms.shape[dim] // 2).zero_()
        return terms

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resample_matmul, "split16", one_term)
        out = resample_batched(images[3:5], plans[3:5], (224, 224))
    errors = [
        (p - _reference(i, plan, (224, 224))).abs().max().item()
        for i, plan, p in zip(images[3:5], plans[3:5].tolist(), out)
    ]
    assert max(errors) > 4 * _tolerance(500, 500), errors  # 0.24 seen, against 0.0155


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made inside (storages freed when
    their last tensor goes; views of the ``inputs`` are not new): a CPU stand-in for the caching
    allocator's peak on the device."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in inputs}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.track(tensor)
        return out

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.live and key not in self.known:
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)


def test_the_working_set_stays_within_the_memory_budget(monkeypatch):
    # What the device would hold: on a CPU, bmm16's float32 copies of its fp16 operands stand in
    # for cuBLAS reading them as they are, so only its float32 output is counted (as on CUDA).
    sizes, g = [(1200, 1600), (1600, 1200), (375, 500), (500, 375), (1, 1), (7, 9)], torch.Generator().manual_seed(6)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    geometry = TrainGeometry(v2.RandomResizedCrop(64, scale=(0.5, 1.0), antialias=True), 0.5)
    with seeded_cpu_rng(6):
        plans = torch.stack([geometry.draw(h, w) for h, w in sizes])
    meter, bmm16 = PeakBytes([*images, plans]), resample_matmul.bmm16

    def as_on_the_device(a, b):
        meter.counting = False
        out = bmm16(a, b)
        meter.counting = True
        meter.track(out)
        return out

    monkeypatch.setattr(resample_matmul, "bmm16", as_on_the_device)
    alone = [chunk_bytes(1, h, w, (64, 64)) for h, w in plans[:, [3, 7]].tolist()]
    budget = max(alone)  # every crop fits alone, the batch does not: chunks
    assert chunk_bytes(len(images), *plans[:, [3, 7]].max(0).values.tolist(), (64, 64)) > 3 * budget
    with meter:
        out = resample_batched(images, plans, (64, 64), OutputFormat(MEAN, STD), budget)
    assert 0 < meter.peak - out.untyped_storage().nbytes() <= budget, (meter.peak, budget)
    unchunked = PeakBytes([*images, plans])
    meter.counting, meter = False, unchunked  # the stand-in now counts for the unchunked run
    with unchunked:
        resample_batched(images, plans, (64, 64), OutputFormat(MEAN, STD), 0)
    assert unchunked.peak > 2 * budget  # the chunks, not a generous estimate, keep it within


def test_a_chunk_out_of_device_memory_is_retried_in_halves_and_one_image_fails_in_one_line(monkeypatch):
    images, plans = _photo_batch(seed=7)
    whole = resample_batched(images[2:], plans[2:], (32, 32))
    resample_chunk, tried = resample_matmul.resample_chunk, []

    def short_of_memory(images, plans, chunk, out, output):
        tried.append(len(chunk))
        if len(chunk) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return resample_chunk(images, plans, chunk, out, output)

    monkeypatch.setattr(resample_matmul, "resample_chunk", short_of_memory)
    halved = resample_batched(images[2:], plans[2:], (32, 32))
    groups = size_groups([tuple(p) for p in plans[2:, [3, 7]].tolist()])
    assert max(map(len, groups)) > 1 and tried.count(1) == 4  # each image alone in the end
    assert len(tried) == sum(2 * len(g) - 1 for g in groups)  # every chunk halved until it fit
    assert torch.equal(halved, whole)

    def always_short(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    monkeypatch.setattr(resample_matmul, "resample_chunk", always_short)
    with pytest.raises(DeviceMemoryError) as e:
        resample_batched(images[:1], plans[:1], (32, 32))
    assert "\n" not in str(e.value) and "one " in str(e.value) and "out of memory" in str(e.value), str(e.value)


def _photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    # Smooth, so JPEG keeps it close and a crop one pixel off shows.
    small = rng.integers(0, 256, (max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR))


@pytest.fixture(scope="module")
def photo_tree(tmp_path_factory) -> Path:
    """Two classes of JPEGs (RGB, greyscale, CMYK; odd sizes, larger and smaller than the 32 px
    crops) and PNGs: every batch mixes them."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    kinds = [("RGB", "jpg", (375, 500)), ("L", "jpg", (45, 63)), ("CMYK", "jpg", (50, 71)), ("RGB", "png", (29, 33)),
             ("RGB", "jpg", (17, 23)), ("RGB", "jpg", (120, 91))]  # fmt: skip
    for split, n in (("train", 12), ("val", 6)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                mode, ext, (h, w) = kinds[i % len(kinds)]
                Image.fromarray(_photo(rng, h, w)).convert(mode).save(root / split / cls / f"{i}.{ext}", quality=92)
    return root


def _cfg(root: Path, decoder: str, workers: int, *extra: str):
    opts = [
        "TRAIN.DATASET",
        str(root),
        "TEST.DATASET",
        str(root),
        "DATA.DECODER",
        decoder,
        "TRAIN.WORKERS",
        str(workers),
    ]
    opts += ["TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8", "DATA.HFLIP_PROB", "0.5", "DATA.CROP_SCALE_MIN", "0.05"]
    return load_cfg(None, [*opts, "MODEL.NUM_CLASSES", "2", "TRAIN.TOPK", "2", *extra])


def _batches(cfg, epoch: int = 1, start: int = 0) -> list:
    split = build_train_split(cfg, DistEnv())
    split.sampler.set_epoch(epoch)
    split.sampler.set_start(start)
    return list(split.loader)


def _assert_close(a: list, b: list, atol: float) -> None:
    assert len(a) == len(b) > 0
    for (images_a, targets_a, _), (images_b, targets_b, _) in zip(a, b):
        assert torch.equal(targets_a, targets_b)
        assert (images_a - images_b).abs().max().item() <= atol


def test_batched_batches_are_todays_per_sample_batches_on_a_cpu(photo_tree):
    # "auto" decodes and augments each image in the workers; on a CPU the batched path resizes with
    # the same uint8 kernel on the same boxes: the same batches (on a GPU, within a level: the
    # matmuls' float pixels are checked against torchvision above).
    _assert_close(_batches(_cfg(photo_tree, "auto", 0)), _batches(_cfg(photo_tree, "batched", 0)), 0.0)
    val = [list(build_val_split(_cfg(photo_tree, d, 0), DistEnv()).loader) for d in ("auto", "batched")]
    _assert_close(*val, 0.0)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # on a 2-core machine
def test_batched_batches_are_the_same_for_0_1_3_workers_and_from_a_mid_epoch_start(photo_tree):
    whole = _batches(_cfg(photo_tree, "batched", 0))
    for workers in (1, 3):
        _assert_close(whole, _batches(_cfg(photo_tree, "batched", workers)), 0.0)
    _assert_close(whole[1:], _batches(_cfg(photo_tree, "batched", 3), start=8), 0.0)  # resumed after one batch


def test_auto_augment_and_erasing_run_per_sample_after_the_batched_crop(photo_tree, caplog):
    # With no per-sample step left the loader hands over normalised floats; with one, the crops
    # are rounded to uint8 and each sample's steps draw from its seed after replaying its crop:
    # rerunning the per-sample transform on the same decoded image gives the same pixels.
    augment = ("DATA.AUTO_AUGMENT", "trivialaugment", "DATA.RANDOM_ERASING", "0.5")
    with caplog.at_level("INFO", logger="distribuuuu.data"):
        split = build_train_split(_cfg(photo_tree, "batched", 0, *augment), DistEnv())
    assert "DATA.AUTO_AUGMENT and DATA.RANDOM_ERASING run per sample after the batched crop" in caplog.text
    decoder = split.loader.decode
    batch = next(iter(split.loader.loader))
    images, _, _ = decoder(batch)
    assert images.dtype == torch.uint8
    after_crop = v2.Compose(_after_crop_and_flip(train_augment(_cfg(photo_tree, "batched", 0, *augment))))
    pixels = decoder.decode(batch)
    for i, image in enumerate(images):
        crop = resample_each([pixels[i]], batch.plans[i : i + 1], (32, 32)).to(torch.uint8)[0]
        with seeded_cpu_rng(batch.seeds[i]):
            decoder.geometry.draw(*pixels[i].shape[1:])
            expected = after_crop(tv_tensors.Image(crop))
        assert torch.equal(image, expected)


def test_without_workers_batches_are_drawn_in_this_thread_and_prepared_on_the_prepare_thread(photo_tree, monkeypatch):
    # TRAIN.WORKERS 0: the dataset's seeded draws must stay in the training thread (they set the
    # global RNG), while the decode and resample, whose per-batch sync would drain the training
    # stream, run on the prepare thread and its side stream.
    threads: dict[str, set] = {"draw": set(), "prepare": set()}
    get_item, prepare = EncodedImageDataset.__getitem__, BatchDecoder.prepare

    def drawn(self, key):
        threads["draw"].add(threading.current_thread().name)
        return get_item(self, key)

    def prepared(self, batch):
        threads["prepare"].add(threading.current_thread().name)
        return prepare(self, batch)

    monkeypatch.setattr(EncodedImageDataset, "__getitem__", drawn)
    monkeypatch.setattr(BatchDecoder, "prepare", prepared)
    assert len(list(build_train_split(_cfg(photo_tree, "batched", 0), DistEnv()).loader)) == 3
    assert threads["draw"] == {threading.current_thread().name}
    assert len(threads["prepare"]) == 1 and threads["prepare"].pop().startswith(THREAD_NAME)


def test_the_memory_budget_is_a_share_of_the_devices_memory_handed_to_the_decoder(photo_tree, monkeypatch):
    split = build_train_split(_cfg(photo_tree, "batched", 0, "DATA.BATCHED_MEMORY_BUDGET", "0.25"), DistEnv())
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert split.loader.decode.memory_budget == int(0.25 * host) > 0
    h200 = type("Properties", (), {"total_memory": 150_754_820_096})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    assert batched_memory_budget(0.05, torch.device("cuda", 0)) == 7_537_741_004  # the default: 7.0 GiB of an H200
    for bad in ("0.0", "1.5"):
        with pytest.raises(ConfigError, match=r"DATA.BATCHED_MEMORY_BUDGET must be in \(0, 1\]"):
            load_cfg(None, ["DATA.BATCHED_MEMORY_BUDGET", bad])


def test_a_device_out_of_memory_for_one_image_ends_the_tool_in_one_line(capsys):
    def main(cfg):
        raise DeviceMemoryError("the device ran out of memory resampling one 4000x3000 crop alone (CUDA out of memory)")

    assert cli.run_main(main, load_cfg(None, [])) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distribuuuu: error: the device ran out of memory resampling"), err
