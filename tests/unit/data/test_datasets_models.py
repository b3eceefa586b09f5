"""CIFAR from torchvision's on-disk files, and pretrained weights: loaded, or one clear error."""

from __future__ import annotations

import pickle
import urllib.error

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from distribuuuu.config import ConfigError, load_cfg
from distribuuuu.data import DataError
from distribuuuu.data.readers import build_base_dataset
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split
from distribuuuu.training.parallelize import build_configured_model

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def cifar10_root(tmp_path):
    """CIFAR-10's python-format files (5 train batches of 6 images, a test batch of 8), tiny."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)

    def dump(name: str, obj: dict) -> None:
        with open(folder / name, "wb") as f:
            pickle.dump(obj, f)

    for i in range(1, 6):
        dump(f"data_batch_{i}", {"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8), "labels": [i] * 6})
    dump("test_batch", {"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), "labels": list(range(8))})
    dump("batches.meta", {"label_names": CIFAR10_NAMES})
    return tmp_path


@pytest.fixture
def skip_md5(monkeypatch):
    """torchvision checks the MD5 of the real CIFAR files; these tiny stand-ins cannot match it."""
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)


def test_cifar10_loads_from_its_on_disk_files_with_train_and_test_splits(cifar10_root, skip_md5):
    train, classes = build_base_dataset(f"cifar10:{cifar10_root}", "train")
    val, _ = build_base_dataset(f"cifar10:{cifar10_root}", "val")
    assert classes == CIFAR10_NAMES
    assert (len(train), len(val)) == (30, 8)
    image, label = train[0]
    assert isinstance(image, Image.Image) and image.size == (32, 32) and label == 1


def test_cifar10_feeds_the_training_loader(cifar10_root, skip_md5):
    root = f"cifar10:{cifar10_root}"
    cfg = load_cfg(opts=["TRAIN.DATASET", root, "TEST.DATASET", root, "TRAIN.BATCH_SIZE", "4", "TRAIN.IM_SIZE", "24"])
    split = build_train_split(cfg, DistEnv())
    images, targets, skipped = next(iter(split.loader))
    assert images.shape == (4, 3, 24, 24) and targets.shape == (4,) and skipped == 0


def test_missing_cifar_files_are_named(cifar10_root):
    (cifar10_root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"cifar10 files missing under .*cifar-10-batches-py: \['data_batch_3'\]"):
        build_base_dataset(f"cifar10:{cifar10_root}", "train")


def test_corrupt_cifar_files_are_one_clear_error(cifar10_root):
    with pytest.raises(DataError, match=r"cifar10 files under .* do not load: .*corrupted"):
        build_base_dataset(f"cifar10:{cifar10_root}", "train")


def test_pretrained_weights_that_cannot_be_fetched_are_a_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no route to download.pytorch.org")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    cfg = load_cfg(opts=["MODEL.PRETRAINED", "True"])
    with pytest.raises(ConfigError, match=r"^MODEL.PRETRAINED: could not load pretrained weights for 'resnet18'"):
        build_configured_model(cfg.MODEL)
    for weights in ("IMAGENET1K_V1", "DEFAULT"):  # the key the user set is the one named, whatever its value
        cfg = load_cfg(opts=["MODEL.PRETRAINED_WEIGHTS", weights])
        with pytest.raises(
            ConfigError, match=r"^MODEL.PRETRAINED_WEIGHTS: could not .* set MODEL.PRETRAINED_WEIGHTS ''$"
        ):
            build_configured_model(cfg.MODEL)


def test_pretrained_weights_load_and_a_new_class_count_gets_a_new_head(monkeypatch):
    imagenet = torchvision.models.resnet18(num_classes=1000).state_dict()
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", lambda *a, **k: imagenet)
    model = build_configured_model(load_cfg(opts=["MODEL.PRETRAINED", "True", "MODEL.NUM_CLASSES", "10"]).MODEL)
    state = model.state_dict()
    assert torch.equal(state["conv1.weight"], imagenet["conv1.weight"])
    assert torch.equal(state["layer4.1.bn2.running_var"], imagenet["layer4.1.bn2.running_var"])
    assert state["fc.weight"].shape == (10, 512)


def test_synthetic_images_are_uint8_pixels_normalised_by_the_loader_as_decoded_ones():
    """MODEL.DUMMY_INPUT hands the workers uint8 images (a quarter of float32's bytes to collate, pin
    and copy) and the loader normalises them on the device with the data's mean and std."""
    from distribuuuu.training.preprocessing import build_normalize

    opts = ["MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", "32", "TRAIN.BATCH_SIZE", "8", "TRAIN.IM_SIZE", "16"]
    cfg = load_cfg(None, [*opts, "TRAIN.WORKERS", "0", "DATA.MEAN", "[0.2, 0.4, 0.6]", "DATA.STD", "[0.5, 0.25, 0.1]"])
    split = build_train_split(cfg, DistEnv())
    pixels, targets, _ = next(iter(split.loader.loader))  # the DataLoader's own batch, before the device
    assert pixels.dtype == torch.uint8 and pixels.shape == (8, 3, 16, 16) and int(pixels.max()) > 200
    images, same_targets, _ = next(iter(split.loader))  # the same first batch: the sampler's epoch-0 order
    mean, std = torch.tensor([0.2, 0.4, 0.6]).view(3, 1, 1), torch.tensor([0.5, 0.25, 0.1]).view(3, 1, 1)
    assert torch.allclose(images, (pixels / 255 - mean) / std, atol=1e-6)
    assert torch.equal(images, build_normalize(cfg)(pixels)) and torch.equal(same_targets, targets)
