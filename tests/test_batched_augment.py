"""DATA.DECODER batched's batched resample: crops drawn in the workers as today's per-sample
transforms draw them, pixels of torchvision's antialiased resized_crop + flip, the same batches for
any number of workers and from any start, and the prepare thread's hand-over."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from distribuuuu.config import load_cfg
from distribuuuu.data.batched import BatchDecoder, EncodedImageDataset
from distribuuuu.data.datasets import seeded_cpu_rng
from distribuuuu.data.prefetch import THREAD_NAME
from distribuuuu.data.resample import EvalGeometry, TrainGeometry, resample_batched, resample_each, size_groups
from distribuuuu.data.transforms import _after_crop_and_flip, _crop_and_flip
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split, build_val_split
from distribuuuu.training.preprocessing import train_augment


def _float32_tolerance(height: int, width: int) -> float:
    # Each output sums at most H then W products of pixels <= 255 with weights summing to 1, in
    # float32 (aten's and ours, in a different order): a rounding error of at most 255 * 2^-24 per
    # term of the two sums.
    return 255 * 2**-24 * (height + width)


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
    out = resample_batched(images, plans, (24, 24))  # a GPU's: float32
    on_cpu = resample_each(images, plans, (24, 24))  # a CPU's: aten's uint8 kernel, today's pixels exactly
    for image, plan, pixels, cpu_pixels in zip(images, plans.tolist(), out, on_cpu):
        error = (pixels - _reference(image, plan, (24, 24))).abs().max().item()
        assert error <= _float32_tolerance(*image.shape[1:]), (plan, error)
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
    assert (out - _reference(image, plan[0].tolist(), (24, 24))).abs().max() > 100 * _float32_tolerance(50, 60)


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
        assert (pixels - reference(image.float())).abs().max() <= _float32_tolerance(*image.shape[1:])
        assert torch.equal(cpu_pixels, reference(image).float())


@pytest.mark.parametrize("hflip", [0.0, 0.5])
def test_the_workers_draws_leave_the_generator_where_the_per_sample_transforms_do(hflip):
    # Same crop, same flip, and the same generator state after them: the steps that follow
    # (auto-augment, erasing) draw what they draw today.
    cfg = load_cfg(None, ["DATA.HFLIP_PROB", str(hflip), "DATA.CROP_SCALE_MIN", "0.08"])
    geometry = TrainGeometry(v2.RandomResizedCrop(32, scale=(0.08, 1.0), antialias=True), hflip)
    per_sample = v2.Compose(_crop_and_flip(train_augment(cfg)))
    for seed, (h, w) in enumerate([(375, 500), (20, 300), (64, 64)]):
        image = tv_tensors.Image(torch.rand(3, h, w) * 255)
        with seeded_cpu_rng(seed):
            plan = geometry.draw(h, w)
            after_draws = torch.get_rng_state()
        with seeded_cpu_rng(seed):
            expected = per_sample(image)
            after_transform = torch.get_rng_state()
        assert torch.equal(after_draws, after_transform)
        out = resample_batched([image.as_subclass(torch.Tensor)], plan[None], (32, 32))[0]
        assert (out - expected).abs().max() <= _float32_tolerance(h, w)


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
