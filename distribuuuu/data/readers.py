"""The dataset formats, one registry: each ``Reader`` says how it recognises a root, how it reads a
split, whether DATA.DECODER batched can take its samples (encoded files), and whether its samples
are reachable only through it (packed shards, a saved Hugging Face dataset: predict.py reads the
split, where it lists a folder's files). ``build_base_dataset`` picks the first that recognises the
root; an ImageFolder is the last, taken by any other root.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torchvision
from torch.utils.data import Dataset

from distribuuuu.data import hf, packed
from distribuuuu.data.annotations import AnnotatedImages, AnnotationSpec, read_annotation_index
from distribuuuu.data.datasets import CheckedImageFolder, check_classes, here
from distribuuuu.data.errors import DataError
from distribuuuu.data.folder_index import FolderIndex, folder_index
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS

CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", ["batches.meta", "test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]),
    "cifar100": ("cifar-100-python", ["meta", "train", "test"]),
}


@dataclass(frozen=True)
class Source:
    """What to read: ``root``'s ``split`` (or the images ``annotations`` lists under ``root``), decoded
    by ``decoder``, images over ``max_pixels`` refused; a split's index made by ``decide(make)``
    (``rank0_decides`` in a run: one process lists it); ``cache_dir``: a packed URL's shard cache;
    ``index_cache``: a folder that keeps a split folder's listing between jobs."""

    root: str
    split: str
    decoder: str = "auto"
    annotations: AnnotationSpec | None = None
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    cache_dir: str = ""
    index_cache: str = ""
    decide: Callable = here


@dataclass(frozen=True)
class Reader:
    """One dataset format."""

    name: str
    recognises: Callable[[Source], bool]
    read: Callable[[Source], tuple[Dataset, list[str]]]
    batched: bool  # its samples are encoded files DATA.DECODER batched can take
    opaque: bool  # its samples are reachable only through it (no files to list)


def _read_annotations(s: Source) -> tuple[Dataset, list[str]]:
    index = s.decide(functools.partial(read_annotation_index, s.root, s.annotations))
    dataset = AnnotatedImages(s.root, s.annotations, s.decoder, s.max_pixels, index)
    return dataset, dataset.classes


def _read_packed(s: Source) -> tuple[Dataset, list[str]]:
    index = s.decide(functools.partial(packed.read_packed_index, s.root, s.split))
    dataset = packed.PackedDataset(s.root, s.split, s.decoder, s.cache_dir, s.max_pixels, index)
    return dataset, dataset.classes


def _read_hf(s: Source) -> tuple[Dataset, list[str]]:
    dataset = hf.HFImageDataset(s.root, s.split, s.decoder, s.max_pixels)
    return dataset, dataset.classes


def _read_folder(s: Source) -> tuple[Dataset, list[str]]:
    folder = os.path.join(s.root, s.split)
    dataset = CheckedImageFolder(
        folder, s.decoder, s.max_pixels, s.decide(functools.partial(_folder_index, folder, s.index_cache))
    )
    check_classes(folder, dataset)
    return dataset, list(dataset.classes)


def _folder_index(folder: str, index_cache: str) -> FolderIndex:
    if not os.path.isdir(folder):
        raise DataError(f"dataset folder not found: {folder}")
    return folder_index(os.path.expanduser(folder), index_cache)


def _read_cifar(s: Source) -> tuple[Dataset, list[str]]:
    kind, _, root = s.root.partition(":")
    return _build_cifar(kind, root, s.split)


def _build_cifar(kind: str, root: str, split: str) -> tuple[Dataset, list[str]]:
    subdir, files = CIFAR_FILES[kind]
    missing = [f for f in files if not os.path.isfile(os.path.join(root, subdir, f))]
    if missing:
        raise DataError(
            f"{kind} files missing under {os.path.join(root, subdir)}: {missing} "
            "(extract the python version of the archive there; nothing is downloaded at run time)"
        )
    cls = torchvision.datasets.CIFAR10 if kind == "cifar10" else torchvision.datasets.CIFAR100
    try:
        dataset = cls(root, train=split == "train", download=False)
    except RuntimeError as e:  # torchvision checks each file's MD5: "Dataset not found or corrupted"
        raise DataError(f"{kind} files under {os.path.join(root, subdir)} do not load: {e}") from None
    return dataset, list(dataset.classes)


READERS: tuple[Reader, ...] = (
    Reader("annotations", lambda s: s.annotations is not None, _read_annotations, batched=True, opaque=False),
    Reader("cifar", lambda s: s.root.partition(":")[0] in CIFAR_FILES, _read_cifar, batched=False, opaque=True),
    Reader("packed", lambda s: packed.is_packed(s.root, s.split), _read_packed, batched=True, opaque=True),
    Reader("hf", lambda s: hf.is_saved_hf(s.root, s.split), _read_hf, batched=True, opaque=True),
    Reader("folder", lambda s: True, _read_folder, batched=True, opaque=False),
)


def reader_for(source: Source) -> Reader:
    """The first reader of ``READERS`` that recognises ``source`` (an ImageFolder at the last)."""
    return next(reader for reader in READERS if reader.recognises(source))


def build_base_dataset(
    root: str,
    split: str,
    decoder: str = "auto",
    cache_dir: str = "",
    annotations: AnnotationSpec | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    index_cache: str = "",
    decide: Callable = here,
) -> tuple[Dataset, list[str]]:
    """An untransformed dataset of (image, target) and its class names, as its reader reads it
    (``Source`` says what each argument is)."""
    source = Source(root, split, decoder, annotations, max_pixels, cache_dir, index_cache, decide)
    reader = reader_for(source)
    dataset, classes = reader.read(source)
    dataset.read_by = reader  # what the loader asks: can DATA.DECODER batched take its samples
    return dataset, classes
