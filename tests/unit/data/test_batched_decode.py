"""DATA.DECODER "batched": one decode_jpeg call per batch in the training process gives exactly the
batches of per-sample decoding in the workers (with DATA.BATCHED_AUGMENT False: the per-sample
transforms; the batched resample's pixels are checked in test_batched_augment.py), names or skips
a bad JPEG, and trains the same weights."""

from __future__ import annotations

import gc
import io
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from helpers import REPO, TINY_ARCH, TINY_TRAIN, assert_ok, in_process, read_metrics, truncated_jpeg
from PIL import Image

from distribuuuu.checkpointing.checkpoint import load_checkpoint, model_state_from
from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import BadImageError, batched, device_decode, jpeg
from distribuuuu.data.batched import BatchDecoder, EncodedSample, collate_encoded, decode_stats
from distribuuuu.data.encoded import decode_image_bytes
from distribuuuu.data.errors import DeviceMemoryError
from distribuuuu.data.loader import DeviceLoader
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.evaluation import check_inputs
from distribuuuu.training.inputs import build_train_split, build_val_split

DIGITS = REPO / "data" / "digits"
PER_CLASS = {"train": 24, "val": 6}


@pytest.fixture(scope="module")
def mixed_tree(tmp_path_factory) -> Path:
    """A digits subset where every other image is re-saved as a JPEG: batches mix JPEGs and PNGs."""
    root = tmp_path_factory.mktemp("mixed")
    for split, n in PER_CLASS.items():
        for cls in sorted(p.name for p in (DIGITS / split).iterdir()):
            dest = root / split / cls
            dest.mkdir(parents=True)
            for i, png in enumerate(sorted((DIGITS / split / cls).glob("*.png"))[:n]):
                if i % 2:
                    Image.open(png).convert("RGB").save(dest / f"{png.stem}.jpg", quality=90)
                else:
                    shutil.copy(png, dest)
    return root


def _cfg(root: Path, decoder: str, workers: int, *extra: str):
    # The per-sample transforms after the batched decode: the pixels of "auto", exactly.
    opts = ["TRAIN.DATASET", str(root), "TEST.DATASET", str(root), "DATA.DECODER", decoder]
    opts += ["DATA.BATCHED_AUGMENT", "False"]
    opts += ["TRAIN.WORKERS", str(workers), "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16", *extra]
    return load_cfg(None, opts)


def _train_batches(root: Path, decoder: str, workers: int, epoch: int, start: int) -> list:
    # Strong augmentation, so a sample given another sample's seed could not go unnoticed.
    augment = ("DATA.AUTO_AUGMENT", "trivialaugment", "DATA.RANDOM_ERASING", "0.5", "DATA.HFLIP_PROB", "0.5")
    split = build_train_split(_cfg(root, decoder, workers, *augment), DistEnv())
    split.sampler.set_epoch(epoch)
    split.sampler.set_start(start)
    return list(split.loader)


def _assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (images_a, targets_a, dropped_a), (images_b, targets_b, dropped_b) in zip(a, b):
        assert torch.equal(images_a, images_b) and torch.equal(targets_a, targets_b)
        assert dropped_a == dropped_b == 0


def test_batched_gives_the_per_sample_batches_exactly_from_any_start(mixed_tree):
    # "auto" decodes each JPEG with torchvision.io and each PNG with PIL in the workers, and
    # augments there; "batched" decodes the JPEGs in the training process: same pixels, same seeds.
    for epoch, start in ((0, 0), (3, 48)):  # a fresh epoch, and one resumed after 3 batches
        per_sample = _train_batches(mixed_tree, "auto", 0, epoch, start)
        batched_batches = _train_batches(mixed_tree, "batched", 2, epoch, start)
        _assert_same_batches(per_sample, batched_batches)
    val = [list(build_val_split(_cfg(mixed_tree, d, w), DistEnv()).loader) for d, w in (("auto", 2), ("batched", 0))]
    _assert_same_batches(*val)


def test_each_batch_is_one_decode_jpeg_call_over_its_jpegs(mixed_tree, monkeypatch):
    calls = []
    decode_jpegs = jpeg.decode_jpegs

    def counting(data, device):
        calls.append(len(data))
        return decode_jpegs(data, device)

    monkeypatch.setattr(jpeg, "decode_jpegs", counting)
    split = build_train_split(_cfg(mixed_tree, "batched", 0), DistEnv())
    assert isinstance(split.loader, DeviceLoader) and split.loader.decode is not None
    batches = list(split.loader)
    jpegs = [sum(1 for i in range(len(b)) if b.shapes[i] is None) for b in split.loader.loader]
    assert calls == jpegs and len(calls) == len(batches) and min(calls) > 1, (calls, jpegs)


@pytest.fixture
def bad_tree(mixed_tree, tmp_path) -> tuple[Path, Path, Path]:
    """The mixed tree plus, in train/3, a truncated JPEG and a PNG named .jpg: (root, bad, misnamed)."""
    root = tmp_path / "data"
    shutil.copytree(mixed_tree, root)
    bad = truncated_jpeg(root / "train" / "3" / "broken.jpg")
    misnamed = root / "train" / "3" / "png_inside.jpg"
    shutil.copy(next((DIGITS / "train" / "3").glob("*.png")), misnamed)
    return root, bad, misnamed


@pytest.mark.parametrize("batched_augment", ["False", "True"])
def test_a_bad_jpeg_in_a_batch_is_named(bad_tree, batched_augment):
    root, bad, _ = bad_tree
    with pytest.raises(BadImageError, match=f"unreadable image {bad}"):
        list(build_train_split(_cfg(root, "batched", 0, "DATA.BATCHED_AUGMENT", batched_augment), DistEnv()).loader)


@pytest.mark.parametrize("batched_augment", ["False", "True"])
def test_skip_drops_and_counts_a_bad_jpeg_and_decodes_a_png_named_jpg(bad_tree, batched_augment):
    # On a CPU the batched resample gives "auto"'s pixels exactly, as the per-sample path does.
    root, _, _ = bad_tree
    opts = ("DATA.BAD_IMAGE", "skip", "DATA.BATCHED_AUGMENT", batched_augment)
    split = build_train_split(_cfg(root, "batched", 2, *opts), DistEnv())
    by_batch = list(split.loader)
    # The decoder's fallback keeps no traceback, whose frames would hold the loader's iterator:
    # dropping the split ends its (persistent) workers at once, without waiting for a collection.
    workers = list(split.loader.loader._iterator._workers)
    gc.disable()
    try:
        del split
        assert not any(w.is_alive() for w in workers), "the workers outlived their loader"
    finally:
        gc.enable()
    per_sample = list(build_train_split(_cfg(root, "auto", 0, "DATA.BAD_IMAGE", "skip"), DistEnv()).loader)
    assert sum(d for _, _, d in by_batch) == sum(d for _, _, d in per_sample) == 1
    for (images_a, targets_a, _), (images_b, targets_b, _) in zip(by_batch, per_sample):
        assert torch.equal(images_a, images_b) and torch.equal(targets_a, targets_b)


@pytest.mark.slow
def test_a_batched_run_trains_the_weights_of_a_per_sample_run(mixed_tree, tmp_path):
    """Training and evaluation through train_net.py's entry point (with the tiny model): the same
    metrics and checkpointed weights."""

    def train(decoder: str, workers: int):
        out = tmp_path / decoder
        args = ["OUT_DIR", str(out), "TRAIN.DATASET", str(mixed_tree), "TEST.DATASET", str(mixed_tree)]
        # The batched resample (the default): on a CPU, "auto"'s pixels exactly, prepared on a thread
        args += [
            "DATA.DECODER",
            decoder,
            "TRAIN.WORKERS",
            str(workers),
            "OPTIM.MAX_EPOCH",
            "2",
            "TRAIN.KEEP_CKPTS",
            "2",
        ]
        args += ["TRAIN.BATCH_SIZE", "16", "TRAIN.PRINT_FREQ", "5", "MODEL.ARCH", TINY_ARCH]  # any model will do
        assert_ok(in_process(TINY_TRAIN, *args))
        weights = [
            model_state_from(load_checkpoint(str(out / "checkpoints" / f"ckpt_ep_00{e}.pth.tar"))) for e in (1, 2)
        ]
        return read_metrics(out), weights

    runs = [train("auto", 0), train("batched", 2)]  # in this process, one after the other
    (metrics_a, (epoch_1, weights_a)), (metrics_b, (_, weights_b)) = runs
    runs_metrics = (metrics_a, metrics_b)
    # Both decoders must log the same numbers. No accuracy or loss floor: 2 epochs of the small
    # model on 240 images are too short for either to move the same way on every CPU (the train
    # loss rose from 2.64 to 2.72 on an AMD EPYC with torch 2.15): that the second epoch changed
    # the weights shows the runs trained.
    for split in ("train", "val"):
        numbers = [[(r["loss"], r["top1"], r["samples"]) for r in m if r["split"] == split] for m in runs_metrics]
        assert numbers[0] == numbers[1] and len(numbers[0]) == 2, (split, numbers)
    learned = [k for k in weights_a if "running_" not in k and "num_batches" not in k]  # not BatchNorm's statistics
    moved = torch.stack([(weights_a[k] - epoch_1[k]).norm() for k in learned]).norm()
    size = torch.stack([epoch_1[k].norm() for k in learned]).norm()
    assert moved > 1e-3 * size, f"epoch 2 barely changed the weights: |dw| {moved:.3g}, |w| {size:.3g}"
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_the_per_sample_transforms_leave_the_cuda_generator_alone(mixed_tree, monkeypatch):
    # torch.manual_seed would reseed CUDA's generator too (dropout on the GPU draws from it) each
    # time a sample is augmented in the training process (TRAIN.WORKERS 0, or "batched").
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    for decoder in ("auto", "batched"):
        next(iter(build_train_split(_cfg(mixed_tree, decoder, 0), DistEnv()).loader))
    assert reseeded == []


def _without_torchcodec(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # import torchcodec now raises ImportError
    monkeypatch.setattr(jpeg, "_torchcodec_decoders", lambda: None)


def test_batched_without_decode_jpeg_is_a_config_error_naming_the_key(monkeypatch):
    # torchvision deprecated its image decoders in 0.29: once a release drops them and TorchCodec
    # is not installed, say so up front.
    _without_torchcodec(monkeypatch)
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    with pytest.raises(ConfigError, match="DATA.DECODER.*decode_jpeg"):
        check_inputs(load_cfg(None, ["DATA.DECODER", "batched"]))  # train_net.py and test_net.py, before any set-up
    check_inputs(load_cfg(None, ["DATA.DECODER", "auto"]))


def _jpeg_batch(*extra: tuple[str, bytes]):
    """Four digits as JPEG bytes (and ``extra`` (name, bytes) samples), collated as the workers do."""
    pngs = sorted((DIGITS / "train" / "5").glob("*.png"))[:4]
    files = []
    for png in pngs:
        out = io.BytesIO()
        Image.open(png).convert("RGB").resize((40, 30)).save(out, "JPEG", quality=90)
        files.append((f"{png.stem}.jpg", out.getvalue()))
    files += extra
    samples = [EncodedSample(torch.frombuffer(bytearray(d), dtype=torch.uint8), True, 5, 0, n) for n, d in files]
    return collate_encoded(samples), files


def _pil_pixels(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


@pytest.fixture
def fresh_stats(monkeypatch):
    """decode_stats at zero and no fallback warned about yet in this process."""
    monkeypatch.setattr(device_decode, "_warned", set())
    decode_stats.reset()
    yield decode_stats
    decode_stats.reset()


def test_a_cuda_decode_first_waits_for_the_kernels_queued_on_the_stream(fresh_stats, monkeypatch):
    # nvJPEG's hardware decoder does not wait for the caller's stream: without a sync it may write
    # into blocks that queued kernels still read. A recording stream and decoder stand in for CUDA.
    events = []

    class Stream:
        def synchronize(self):
            events.append("sync")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    def decode(data, device):
        events.append("decode")
        return [decode_image_bytes(d.numpy().tobytes(), "x.jpg", "auto") for d in data]

    batch, _ = _jpeg_batch()
    decoder = BatchDecoder(lambda image: image, torch.device("cuda"), decode_jpegs=decode)
    decoder.decode(batch)
    decoder.decode(batch)
    assert events == ["sync", "decode"] * 2
    assert fresh_stats.gpu_images == 8 and fresh_stats.cpu_fallback_images == 0


def test_a_missing_device_decoder_falls_back_to_the_cpu_once_with_one_warning(fresh_stats, caplog):
    calls = []

    def no_nvjpeg(data, device):
        calls.append(len(data))
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    batch, files = _jpeg_batch()
    decoder = BatchDecoder(lambda image: image, torch.device("cpu"), decode_jpegs=no_nvjpeg)
    with caplog.at_level(logging.WARNING, logger="distribuuuu.data"):
        first, second = decoder.decode(batch), decoder.decode(batch)
        BatchDecoder(lambda image: image, torch.device("cpu"), decode_jpegs=no_nvjpeg).decode(batch)
    # The error says the decoder is missing: no more device calls on that decoder, not even one
    # image at a time; the second decoder (the val split's) tries once more.
    assert calls == [4, 4]
    warnings = [r.getMessage() for r in caplog.records if "batched JPEG decoder" in r.getMessage()]
    assert len(warnings) == 1 and "not compiled with nvJPEG" in warnings[0], caplog.text
    assert fresh_stats.gpu_images == 0 and fresh_stats.cpu_fallback_images == 12
    for pixels in (first, second):
        for image, (_, data) in zip(pixels, files):
            assert torch.equal(image, _pil_pixels(data))  # the same libjpeg-turbo decode


def test_a_corrupt_jpeg_among_good_ones_is_skipped_and_the_device_decoder_kept(fresh_stats, tmp_path, caplog):
    bad = truncated_jpeg(tmp_path / "broken.jpg")
    batch, files = _jpeg_batch((str(bad), bad.read_bytes()))
    decoder = BatchDecoder(lambda image: image, torch.device("cpu"), skip_bad=True)
    with caplog.at_level(logging.WARNING, logger="distribuuuu.data"):
        pixels = decoder.decode(batch)
    assert pixels[4] is None and decoder.jpegs.works
    assert all(torch.equal(image, _pil_pixels(data)) for image, (_, data) in zip(pixels[:4], files))
    assert fresh_stats.gpu_images == 4 and fresh_stats.cpu_fallback_images == 0
    assert "batched JPEG decoder" not in caplog.text


def _nvjpeg_like(calls: list[int]):
    """A device decoder that, like nvJPEG, fails the whole call when one file is no 1- or 3-component
    JPEG ("Unknown chroma subsampling"), else decodes the JPEGs (with libjpeg-turbo, on the CPU)."""

    def decode(data, device):
        calls.append(len(data))
        for d in data:
            header = Image.open(io.BytesIO(d.numpy().tobytes()))
            if header.format != "JPEG" or header.mode not in ("L", "RGB"):
                raise RuntimeError("Unknown chroma subsampling")
        return jpeg.decode_jpegs(data, torch.device("cpu"))

    return decode


class _Files(torch.utils.data.Dataset):
    """A reader of (name, bytes) files, as the dataset formats' ``encoded`` gives them."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def encoded(self, index):
        name, data = self.files[index]
        return data, name, 0


def test_files_nvjpeg_cannot_take_are_decoded_on_the_cpu_one_each_and_the_rest_stay_in_one_call(
    fresh_stats, monkeypatch
):
    # A CMYK JPEG (ImageNet has ~22) and a PNG named .JPEG: their headers, read in the workers, send
    # them to the CPU decoder there; the batch's other JPEGs stay one device call, not one each.
    _, files = _jpeg_batch()
    rgb = Image.open(io.BytesIO(files[0][1])).convert("RGB")
    cmyk, png = io.BytesIO(), io.BytesIO()
    rgb.convert("CMYK").save(cmyk, "JPEG", quality=90)
    rgb.save(png, "PNG")
    files = files * 4 + [("cmyk.JPEG", cmyk.getvalue()), ("png_inside.JPEG", png.getvalue())]
    cpu_decodes, calls = [], []
    for module in (batched, device_decode):
        counted = module.decode_image_bytes
        monkeypatch.setattr(
            module, "decode_image_bytes", lambda *a, counted=counted: cpu_decodes.append(a[1]) or counted(*a)
        )
    dataset = batched.EncodedImageDataset(_Files(files), seed=0)
    batch = collate_encoded([dataset[i] for i in range(len(files))])
    pixels = BatchDecoder(None, torch.device("cpu"), decode_jpegs=_nvjpeg_like(calls)).decode(batch)
    assert calls == [16] and sorted(cpu_decodes) == ["cmyk.JPEG", "png_inside.JPEG"]
    assert fresh_stats.gpu_images == 16 and fresh_stats.cpu_fallback_images == 0
    for image, (_, data) in zip(pixels, files):
        assert torch.equal(image, _pil_pixels(data))


def one_sample(batch, i: int) -> EncodedSample:
    return EncodedSample(batch.data(i), True, 5, 0, batch.paths[i])


def test_out_of_memory_halves_the_call_and_one_image_alone_fails_in_one_line(fresh_stats):
    batch, files = _jpeg_batch(*_jpeg_batch()[1])  # 8 JPEGs
    calls = []

    def short_of_memory(data, device):
        calls.append(len(data))
        if len(data) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return jpeg.decode_jpegs(data, device)

    decoder = BatchDecoder(None, torch.device("cpu"), decode_jpegs=short_of_memory)
    pixels = decoder.decode(batch)
    assert calls == [8, 4, 2, 2, 4, 2, 2] and decoder.jpegs.works  # halved until it fit: retried, not given up
    assert fresh_stats.gpu_images == 8 and fresh_stats.cpu_fallback_images == 0
    assert all(torch.equal(image, _pil_pixels(data)) for image, (_, data) in zip(pixels, files))
    one, _ = _jpeg_batch()
    with pytest.raises(DeviceMemoryError) as e:
        BatchDecoder(
            None, torch.device("cpu"), decode_jpegs=lambda data, device: short_of_memory(data * 3, device)
        ).decode(collate_encoded([one_sample(one, 0)]))
    assert "\n" not in str(e.value) and "out of memory decoding" in str(e.value) and files[0][0] in str(e.value)


def test_a_failed_call_that_is_no_missing_decoder_keeps_the_device_decoder(fresh_stats, caplog):
    # A CUDA error on every call of one batch (each image alone too): that batch is decoded on the
    # CPU, and the next batch goes to the device again. Before, one such batch turned it off for
    # the rest of the run.
    batch, files = _jpeg_batch()
    calls, failing = [], [True]

    def flaky(data, device):
        calls.append(len(data))
        if failing[0]:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return jpeg.decode_jpegs(data, device)

    decoder = BatchDecoder(None, torch.device("cpu"), decode_jpegs=flaky)
    with caplog.at_level(logging.WARNING, logger="distribuuuu.data"):
        first = decoder.decode(batch)
        failing[0] = False
        second = decoder.decode(batch)
    assert calls == [4, 2, 1, 1, 2, 1, 1, 4] and decoder.jpegs.works
    assert fresh_stats.gpu_images == 4 and fresh_stats.cpu_fallback_images == 4
    assert "missing" not in caplog.text
    for pixels in (first, second):
        assert all(torch.equal(image, _pil_pixels(data)) for image, (_, data) in zip(pixels, files))
