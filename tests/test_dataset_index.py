"""The dataset index: the very samples, classes and targets torchvision's ImageFolder (or the
annotation reader) lists, built once per job (global rank 0 scans, the other ranks receive it),
held in arrays (a few bytes a sample in the rank; nothing a forked worker copies as it reads), and
cached on disk (DATA.INDEX_CACHE) keyed by the folder's directories, so that a changed folder is
scanned again and a damaged or foreign cache file is never trusted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import REPO, on_ranks
from PIL import Image
from torchvision.datasets import ImageFolder

from benchmarks.index import make_linked_folder, path_bytes, retained_bytes, worker_growth
from distribuuuu.config import get_cfg_defaults, validate_cfg
from distribuuuu.data.annotations import AnnotationSpec, read_annotations
from distribuuuu.data.datasets import build_base_dataset
from distribuuuu.data.errors import DataError
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_extra_val_splits, build_train_split, build_val_split

DIGITS = REPO / "data" / "digits"
BIG = 100_000  # entries of the memory tests' folder: a few seconds, and 10x its fixed costs


def _reference(folder: Path) -> ImageFolder:
    """The independent listing: torchvision's own ImageFolder, as every rank built it before."""
    return ImageFolder(str(folder), allow_empty=True)


def _assert_lists_like_imagefolder(dataset, classes: list[str], folder: Path) -> None:
    reference = _reference(folder)
    assert list(dataset.samples) == reference.samples
    assert list(dataset.targets) == reference.targets
    assert classes == dataset.classes == reference.classes and dataset.class_to_idx == reference.class_to_idx
    assert all(type(t) is int for _, t in list(dataset.samples)[:3])  # what a batch collates: Python ints


def _odd_tree(root: Path) -> Path:
    """A split folder with what names can hold: spaces, unicode, a nested folder, extensions in any
    case, files that are no images (left out), a hidden image, a file at the top (no class), a
    symbolic link to a folder, and a name that is not UTF-8 (a Linux file name is bytes)."""
    split = root / "train"
    png = Image.new("RGB", (4, 4), (200, 10, 10))
    for rel in (
        "a class/img 1.png", "a class/img 2.PNG", "a class/nested/deeper/x.jpeg", "a class/nested/y.JpG",
        "café/été.png", "café/.hidden.png", "日本/画像.webp", "z/0.png", "z/notes.txt", "z/README",
    ):  # fmt: skip
        path = split / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        png.save(path, "PNG") if rel.lower().endswith((".png", ".jpeg", ".jpg", ".webp")) else path.write_text("x")
    (split / "top.png").write_bytes((split / "z" / "0.png").read_bytes())
    os.symlink(split / "café", split / "z" / "linked")
    with open(os.path.join(os.fsencode(split / "z"), b"\xff\xfe bytes.png"), "wb") as f:
        f.write((split / "z" / "0.png").read_bytes())
    return split


def _settle(folder: Path, age_s: float = 3600) -> None:
    """Date every folder of the tree ``age_s`` back: a folder changed in the last moments before a scan
    is not cached (a change in the same timestamp tick would go unseen), and this tree was just made."""
    past = os.stat(folder).st_mtime - age_s
    for path, dirs, _ in os.walk(folder):
        for d in [path, *(os.path.join(path, d) for d in dirs)]:
            os.utime(d, (past, past), follow_symlinks=True)


@pytest.fixture
def count_scans(monkeypatch):
    """Count the directory listings (os.scandir, which os.walk calls too) of anything under a folder."""
    listed: list[str] = []
    scandir = os.scandir

    def counting(path="."):
        listed.append(os.fsdecode(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counting)

    def under(folder: Path) -> int:
        return sum(1 for p in listed if os.path.abspath(p).startswith(os.path.abspath(folder)))

    return under


# ------------------------------------------------------------------------------------------------
# The same samples as ImageFolder
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "val"])
def test_the_index_lists_imagefolders_samples_classes_and_targets_on_the_digits(split):
    dataset, classes = build_base_dataset(str(DIGITS), split)
    _assert_lists_like_imagefolder(dataset, classes, DIGITS / split)
    image, target = dataset[7]
    assert target == _reference(DIGITS / split)[7][1] and image.size == (8, 8)


def test_the_index_lists_imagefolders_samples_of_nested_unicode_and_non_utf8_names(tmp_path):
    split = _odd_tree(tmp_path)
    dataset, classes = build_base_dataset(str(tmp_path), "train")
    _assert_lists_like_imagefolder(dataset, classes, split)
    assert any("\udcff" in path for path, _ in dataset.samples)  # the non-UTF-8 name, as os.fsdecode gives it
    assert all(os.path.isfile(path) for path, _ in dataset.samples)


def test_the_annotation_reader_lists_its_files_samples_in_arrays(tmp_path):
    reference = _reference(_odd_tree(tmp_path))
    texts = [(p, t) for p, t in reference.samples if p.isprintable()]  # an annotation file is UTF-8 text
    with open(tmp_path / "list.csv", "w", encoding="utf-8") as f:
        f.write("path,label\n")
        f.writelines(f'"{os.path.relpath(path, tmp_path)}",{reference.classes[t]}\n' for path, t in texts)
    spec = AnnotationSpec("list.csv", header=True)
    dataset, classes = build_base_dataset(str(tmp_path), "train", annotations=spec)
    listed, listed_classes = read_annotations(str(tmp_path), spec)
    assert list(dataset.samples) == listed == texts and classes == listed_classes == reference.classes
    assert list(dataset.targets) == [t for _, t in texts]


# ------------------------------------------------------------------------------------------------
# Built once per job
# ------------------------------------------------------------------------------------------------
def _cfg(*opts: str):
    c = get_cfg_defaults()
    c.merge_from_list(["TRAIN.DATASET", str(DIGITS), "TEST.DATASET", str(DIGITS), "TRAIN.WORKERS", "0", *opts])
    validate_cfg(c)
    return c


def _splits(config, env: DistEnv) -> list:
    """The train, val and extra val splits' samples, as a run builds them on this rank."""
    train = build_train_split(config, env)
    splits = [train, build_val_split(config, env, train.classes)]
    splits += build_extra_val_splits(config, env, train.classes).values()
    return [list(split.dataset.base.samples) for split in splits]


def test_two_ranks_started_together_scan_each_split_once(count_scans):
    config = _cfg("TEST.EXTRA_DATASETS", f"['{DIGITS}']")
    alone = _splits(config, DistEnv())
    one_process = count_scans(DIGITS)
    assert one_process > 0
    ranks = on_ranks(2, lambda rank: _splits(config, DistEnv(rank=rank, world_size=2)))
    assert ranks == [alone, alone]
    assert count_scans(DIGITS) - one_process == one_process, "two ranks listed the folders more than one rank does"


def test_a_failed_scan_on_rank_0_is_the_same_one_line_error_on_every_rank(tmp_path):
    shutil.copytree(DIGITS / "train", tmp_path / "train")
    (tmp_path / "train" / "empty class").mkdir()
    config = _cfg("TRAIN.DATASET", str(tmp_path))

    def rank_job(rank: int) -> str:
        with pytest.raises(DataError) as e:
            build_train_split(config, DistEnv(rank=rank, world_size=2))
        return str(e.value)

    first, second = on_ranks(2, rank_job, timeout=60)
    assert first == second and "empty class" in first and "\n" not in first


# ------------------------------------------------------------------------------------------------
# A few bytes a sample
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> Path:
    """BIG hard links of a tiny JPEG, named as ImageNet's train split is, in 100 class folders."""
    return Path(make_linked_folder(str(tmp_path_factory.mktemp("big") / "train"), BIG, 100))


def _annotated(folder: Path) -> tuple[str, AnnotationSpec]:
    """An annotation file listing ``folder``'s files (the root is its parent); ImageFolder's order."""
    reference = _reference(folder)
    with open(folder.parent / "list.txt", "w") as f:
        f.writelines(f"{os.path.relpath(p, folder.parent)} {reference.classes[t]}\n" for p, t in reference.samples)
    return str(folder.parent), AnnotationSpec("list.txt")


@pytest.mark.parametrize("reader", ["folder", "annotations"])
def test_a_dataloader_worker_grows_at_most_16_bytes_a_sample_over_an_epoch(big_folder, reader):
    # Reading a list of tuples writes their reference counts (and the collector their headers), so
    # fork's copy-on-write copies every page the worker reads: 161 B a sample at ImageNet size.
    # Measured as a slope, between an epoch of a tenth of the samples and one of them all (with
    # a worker forked afresh for each): what a worker copies at start-up and its first batches is in both.
    # Margin: one obmalloc arena (1 MiB, the step in which a worker's Python heap grows) either way.
    root, spec = _annotated(big_folder) if reader == "annotations" else (str(big_folder.parent), None)
    dataset, _ = build_base_dataset(root, "train", annotations=spec)
    assert len(dataset) == BIG
    [tenth] = worker_growth(dataset.samples, BIG // 10)
    [whole] = worker_growth(dataset.samples)
    per_sample_budget, arena = 16, 1 << 20
    assert whole - tenth <= per_sample_budget * (BIG - BIG // 10) + arena, (
        f"a worker grew {(whole - tenth) / (BIG - BIG // 10):.1f} B a sample ({tenth:,} B over a tenth, {whole:,} B over all)"
    )


@pytest.mark.parametrize("reader", ["folder", "annotations"])
def test_the_rank_holds_its_index_in_at_most_twice_its_paths_bytes(big_folder, reader):
    root, spec = _annotated(big_folder) if reader == "annotations" else (str(big_folder.parent), None)
    (dataset, _), held = retained_bytes(lambda: build_base_dataset(root, "train", annotations=spec))
    paths = path_bytes(dataset.samples)
    assert held <= 2 * paths, f"the index holds {held / BIG:.1f} B a sample, its paths {paths / BIG:.1f}"
