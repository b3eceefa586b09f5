"""The dataset index: the very samples, classes and targets torchvision's ImageFolder (or the
annotation reader) lists, built once per job (global rank 0 scans, the other ranks receive it),
held in arrays (a few bytes a sample in the rank; nothing a forked worker copies as it reads), and
cached on disk (DATA.INDEX_CACHE) keyed by the folder's directories, so that a changed folder is
scanned again and a damaged or foreign cache file is never trusted."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from helpers import REPO, on_ranks
from PIL import Image
from torchvision.datasets import ImageFolder

from benchmarks.index import make_linked_folder, path_bytes, retained_bytes, worker_growth
from distribuuuu.config import get_cfg_defaults, validate_cfg
from distribuuuu.data.annotations import AnnotationSpec, read_annotations
from distribuuuu.data.errors import DataError
from distribuuuu.data.readers import build_base_dataset
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


@pytest.mark.parametrize("multilabel", [False, True])
def test_class_remapping_keeps_and_maps_the_samples_a_list_would(multilabel):
    # The list semantics remap_targets had: a class index the mapping lacks drops its sample; a
    # multi-label sample keeps the classes it maps, sorted (and itself, with none left: a negative).
    import numpy as np

    from distribuuuu.data.index import Labels, Samples, Strings

    rng = np.random.default_rng(0)
    names = [f"c{i % 7}/img {i}.png" for i in range(200)]
    if multilabel:
        targets = [tuple(sorted(rng.choice(7, size=rng.integers(0, 4), replace=False).tolist())) for _ in names]
    else:
        targets = rng.integers(0, 7, size=len(names)).tolist()
    mapping = {0: 5, 2: 0, 3: 3, 5: 1, 6: 9}  # 1 and 4 unmapped; the order of classes changes
    samples = Samples(Strings.of(names), Labels.of(targets, multilabel), "/data", np.arange(200) * 3)
    if multilabel:
        expected = [
            (f"/data/{n}", tuple(sorted(mapping[c] for c in t if c in mapping))) for n, t in zip(names, targets)
        ]
        rows = list(range(0, 600, 3))
    else:
        kept = [i for i, t in enumerate(targets) if t in mapping]
        expected = [(f"/data/{names[i]}", mapping[targets[i]]) for i in kept]
        rows = [3 * i for i in kept]
    mapped = samples.mapped(mapping)
    assert list(mapped) == expected and mapped.all_rows().tolist() == rows
    assert list(mapped.labels) == [t for _, t in expected]


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


def _counting(monkeypatch, module, name: str) -> list:
    """Count the calls of ``module.name`` (made from any thread)."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _annotated_digits(root: Path) -> list[str]:
    """Annotation files listing the digits' train and val splits: the config keys that read them."""
    for split in ("train", "val"):
        reference = _reference(DIGITS / split)
        with open(root / f"{split}.txt", "w") as f:
            f.writelines(f"{p} {reference.classes[t]}\n" for p, t in reference.samples)
    return ["TRAIN.ANN_FILE", "train.txt", "TEST.ANN_FILE", "val.txt", "TRAIN.DATASET", str(root),
            "TEST.DATASET", str(root)]  # fmt: skip


def _packed_digits(root: Path) -> list[str]:
    from distribuuuu.data.pack import PackOptions, pack_split

    for split in ("train", "val"):
        pack_split(str(DIGITS), split, str(root / "packed"), PackOptions(shard_size=500))
    packed = str(root / "packed")
    return ["TRAIN.DATASET", packed, "TEST.DATASET", packed, "DATA.SHARD_CACHE", str(root / "links")]


@pytest.mark.parametrize("kind", ["annotations", "packed"])
def test_two_ranks_read_an_annotation_file_or_a_packed_index_once_a_split(tmp_path, monkeypatch, kind):
    from distribuuuu.data import annotations, packed

    config = _cfg(*(_annotated_digits(tmp_path) if kind == "annotations" else _packed_digits(tmp_path)))
    calls = _counting(monkeypatch, *((annotations, "_read") if kind == "annotations" else (packed, "load_index")))
    alone = _splits(config, DistEnv())
    assert len(calls) == 2  # train and val
    assert on_ranks(2, lambda rank: _splits(config, DistEnv(rank=rank, world_size=2))) == [alone, alone]
    assert len(calls) == 4, "two ranks read a split's list more than once"


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
# Kept between jobs (DATA.INDEX_CACHE)
# ------------------------------------------------------------------------------------------------
def _cached_build(root: Path, cache: Path):
    return build_base_dataset(str(root), "train", index_cache=str(cache))


def _change(split: Path, change: str) -> None:
    """One change of the listing: what a folder's mtime must reveal."""
    if change == "file added":
        shutil.copy(split / "z" / "0.png", split / "z" / "1.png")
    elif change == "file removed":
        (split / "café" / "été.png").unlink()
    elif change == "file renamed":
        (split / "a class" / "img 1.png").rename(split / "a class" / "img 0.png")
    elif change == "file renamed in a nested folder":
        (split / "a class" / "nested" / "deeper" / "x.jpeg").rename(split / "a class" / "nested" / "deeper" / "w.jpeg")
    elif change == "class folder added":
        (split / "new").mkdir()
        shutil.copy(split / "z" / "0.png", split / "new" / "0.png")
    elif change == "class folder renamed":
        (split / "z").rename(split / "y")
    elif change == "nested folder added":
        (split / "z" / "sub").mkdir()
        shutil.copy(split / "z" / "0.png", split / "z" / "sub" / "0.png")
    elif change == "linked folder's target changed":
        shutil.copy(split / "café" / "été.png", split / "café" / "autre.png")  # listed under z/linked too


CHANGES = [
    "file added", "file removed", "file renamed", "file renamed in a nested folder", "class folder added",
    "class folder renamed", "nested folder added", "linked folder's target changed",
]  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_folder_is_listed_again_and_a_same_one_is_not_listed(tmp_path, count_scans, change):
    split = _odd_tree(tmp_path / "data")
    _settle(split)
    cache = tmp_path / "cache"
    first, _ = _cached_build(split.parent, cache)
    assert len(list(cache.iterdir())) == 1, "the index was not cached"
    listed = count_scans(split)
    again, _ = _cached_build(split.parent, cache)
    assert count_scans(split) == listed, "an unchanged folder was listed again"
    assert list(again.samples) == list(first.samples) and again.classes == first.classes
    _change(split, change)
    changed, classes = _cached_build(split.parent, cache)
    assert count_scans(split) > listed, "a changed folder was read from its cache"
    _assert_lists_like_imagefolder(changed, classes, split)
    assert list(changed.samples) != list(first.samples)


def test_a_folder_changed_moments_before_it_is_listed_is_not_cached(tmp_path, count_scans):
    # A change in the same timestamp tick as the one recorded would go unseen: a folder whose mtime
    # is that recent is listed again next time rather than trusted.
    split = _odd_tree(tmp_path / "data")
    _settle(split)
    os.utime(split / "z")  # now
    _cached_build(split.parent, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def _damaged(cache_file: Path, how: str, other: Path) -> None:
    """Damage a valid index cache file ``how``."""
    from distribuuuu.data.index_file import MAGIC

    data = cache_file.read_bytes()
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    header = json.loads(data[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
    if how == "truncated":
        cache_file.write_bytes(data[: len(data) // 2])
    elif how == "a byte of its arrays flipped":
        cache_file.write_bytes(data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])
    elif how == "no index file":
        cache_file.write_bytes(b"GIF89a" + bytes(64))
    elif how == "a header of 2**60 bytes":
        cache_file.write_bytes(MAGIC + (1 << 60).to_bytes(8, "little") + data[len(MAGIC) + 8 :])
    elif how == "arrays of 2**60 entries":  # a header that would have np.load allocate exabytes
        header["arrays"] = [[name, dtype, 1 << 60] for name, dtype, _ in header["arrays"]]
        raw = json.dumps(header).encode()
        cache_file.write_bytes(MAGIC + len(raw).to_bytes(8, "little") + raw + data[len(MAGIC) + 8 + length :])
    elif how == "a pickle":
        cache_file.write_bytes(pickle.dumps({"samples": [("/etc/passwd", 0)]}))
    elif how == "targets out of range, checksum right":
        from distribuuuu.data.index_file import read_index_file, write_index_file

        meta, arrays = read_index_file(str(cache_file), header["kind"])
        write_index_file(str(cache_file), header["kind"], meta, {**arrays, "targets": arrays["targets"] + 1000})
    elif how == "another folder's index":
        shutil.copy(other, cache_file)


DAMAGES = [
    "truncated", "a byte of its arrays flipped", "no index file", "a header of 2**60 bytes", "arrays of 2**60 entries",
    "a pickle", "targets out of range, checksum right", "another folder's index",
]  # fmt: skip


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_or_foreign_cache_file_is_listed_again_not_trusted(tmp_path, caplog, count_scans, how):
    split = _odd_tree(tmp_path / "data")
    other = shutil.copytree(DIGITS / "val", tmp_path / "other" / "train")
    _settle(split)
    _settle(other)
    cache = tmp_path / "cache"
    _cached_build(other.parent, cache)
    [other_file] = list(cache.iterdir())
    other_copy = shutil.copy(other_file, tmp_path / "other.idx")
    _cached_build(split.parent, cache)
    [cache_file] = [f for f in cache.iterdir() if f != other_file]
    _damaged(cache_file, how, Path(other_copy))
    listed = count_scans(split)
    with caplog.at_level("WARNING", logger="distribuuuu"):
        dataset, classes = _cached_build(split.parent, cache)
    assert count_scans(split) > listed, "the damaged cache was read as the index"
    _assert_lists_like_imagefolder(dataset, classes, split)
    assert str(cache_file) in caplog.text and "listing" in caplog.text
    listed = count_scans(split)
    _cached_build(split.parent, cache)
    assert count_scans(split) == listed, "the listing did not replace the damaged cache file"


def test_a_read_only_dataset_folder_is_indexed_with_its_cache_elsewhere(tmp_path, count_scans):
    split = _odd_tree(tmp_path / "data")
    _settle(split)
    before = sorted(os.walk(split))
    folders = [path for path, _, _ in os.walk(split)]
    for path in folders:
        os.chmod(path, 0o555)
    try:
        _cached_build(split.parent, tmp_path / "cache")
        listed = count_scans(split)
        dataset, classes = _cached_build(split.parent, tmp_path / "cache")
        assert count_scans(split) == listed
        _assert_lists_like_imagefolder(dataset, classes, split)
        assert sorted(os.walk(split)) == before, "something was written into the dataset folder"
    finally:
        for path in folders:
            os.chmod(path, 0o755)


def test_an_unwritable_cache_folder_is_a_warning_and_the_index_is_used(tmp_path, caplog):
    split = _odd_tree(tmp_path / "data")
    _settle(split)
    (tmp_path / "a file").write_text("not a folder")
    with caplog.at_level("WARNING", logger="distribuuuu"):
        dataset, classes = _cached_build(split.parent, tmp_path / "a file" / "cache")
    _assert_lists_like_imagefolder(dataset, classes, split)
    assert "index cache" in caplog.text and "not written" in caplog.text


@pytest.mark.parametrize("value", ["a file", "http://host/cache"])
def test_the_index_cache_must_be_a_local_folder(tmp_path, value):
    from distribuuuu.config import ConfigError

    (tmp_path / "a file").write_text("")
    with pytest.raises(ConfigError, match="DATA.INDEX_CACHE must be a local folder"):
        _cfg("DATA.INDEX_CACHE", str(tmp_path / value) if value == "a file" else value)


def test_a_job_of_two_ranks_reads_the_cache_another_job_wrote(tmp_path, count_scans):
    shutil.copytree(DIGITS, tmp_path / "digits")
    _settle(tmp_path / "digits")
    config = _cfg("TRAIN.DATASET", str(tmp_path / "digits"), "TEST.DATASET", str(tmp_path / "digits"),
                  "DATA.INDEX_CACHE", str(tmp_path / "cache"))  # fmt: skip
    first = _splits(config, DistEnv())
    listed = count_scans(tmp_path / "digits")
    assert on_ranks(2, lambda rank: _splits(config, DistEnv(rank=rank, world_size=2))) == [first, first]
    assert count_scans(tmp_path / "digits") == listed, "a rank listed a folder its cache holds"


# ------------------------------------------------------------------------------------------------
# A few bytes a sample
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> Path:
    """BIG hard links of a tiny JPEG, named as ImageNet's train split is, in 100 class folders."""
    return Path(make_linked_folder(str(tmp_path_factory.mktemp("big") / "train"), BIG, 100))


@pytest.fixture(scope="module")
def big_annotations(big_folder) -> AnnotationSpec:
    """An annotation file beside ``big_folder`` listing its files in ImageFolder's order."""
    reference = _reference(big_folder)
    with open(big_folder.parent / "list.txt", "w") as f:
        f.writelines(f"{os.path.relpath(p, big_folder.parent)} {reference.classes[t]}\n" for p, t in reference.samples)
    return AnnotationSpec("list.txt")


def _big_dataset(request, big_folder: Path, reader: str) -> tuple[str, AnnotationSpec | None]:
    """The root and the annotation spec (None: the folder itself) of ``reader``'s big dataset."""
    return str(big_folder.parent), request.getfixturevalue("big_annotations") if reader == "annotations" else None


READERS = ["folder", pytest.param("annotations", marks=pytest.mark.slow)]  # reading 100k lines: 10-25 s


@pytest.mark.parametrize("reader", READERS)
def test_a_dataloader_worker_grows_at_most_16_bytes_a_sample_over_an_epoch(request, big_folder, reader):
    # Reading a list of tuples writes their reference counts (and the collector their headers), so
    # fork's copy-on-write copies every page the worker reads: 177 B a sample here, before.
    # Measured as a slope, between an epoch of a tenth of the samples and one of them all (with
    # a worker forked afresh for each): what a worker copies at start-up and its first batches is in both.
    # Margin: one obmalloc arena (1 MiB, the step in which a worker's Python heap grows) either way.
    root, spec = _big_dataset(request, big_folder, reader)
    dataset, _ = build_base_dataset(root, "train", annotations=spec)
    assert len(dataset) == BIG
    [tenth] = worker_growth(dataset.samples, BIG // 10)
    [whole] = worker_growth(dataset.samples)
    per_sample_budget, arena = 16, 1 << 20
    assert whole - tenth <= per_sample_budget * (BIG - BIG // 10) + arena, (
        f"a worker grew {(whole - tenth) / (BIG - BIG // 10):.1f} B a sample ({tenth:,} B over a tenth, {whole:,} B over all)"
    )


@pytest.mark.parametrize("reader", READERS)
def test_the_rank_holds_its_index_in_at_most_twice_its_paths_bytes(request, big_folder, reader):
    # Before: 191 B a sample for 70 B paths (a tuple, a string and a list slot each, and the targets' list).
    root, spec = _big_dataset(request, big_folder, reader)
    (dataset, _), held = retained_bytes(lambda: build_base_dataset(root, "train", annotations=spec))
    paths = path_bytes(dataset.samples)
    assert held <= 2 * paths, f"the index holds {held / BIG:.1f} B a sample, its paths {paths / BIG:.1f}"


# ------------------------------------------------------------------------------------------------
# The packed reader's open shards
# ------------------------------------------------------------------------------------------------
def _odd_tar(path: Path) -> Path:
    """A tar as WebDataset writers leave them: samples of one to three files (a key may hold dots
    and folders), a long name (a pax header before it), a folder member, a file without a dot."""
    import io
    import tarfile

    members = [
        ("000.jpg", b"a"), ("000.cls", b"1"), ("001.png", b"bb"), ("dir/002.x.jpg", b"ccc"), ("dir/002.x.cls", b"2"),
        ("dir/002.x.json", b"{}"), ("NODOT", b"?"), ("003.jpg", b"d" * 700), ("l" * 150 + ".jpg", b"e"),
        ("004.jpg", b""), ("004.cls", b"4"),
    ]  # fmt: skip
    # (No name twice: wids's index numbers its files by their distinct names, and reads another file then.)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo("a folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _as_dict(sample: dict) -> dict:
    return {k: v.getvalue() if hasattr(v, "getvalue") else v for k, v in sample.items()}


def test_a_shard_reads_the_samples_wids_reads(tmp_path):
    from wids.wids import IndexedTarSamples

    from distribuuuu.data.tar_samples import TarSamples

    tar = _odd_tar(tmp_path / "odd.tar")
    mine, theirs = TarSamples(str(tar)), IndexedTarSamples(path=str(tar))
    try:
        # 5: the long name's ustar header holds it cut to 100 characters, no dot: passed over by both
        assert len(mine) == len(theirs) == 5
        assert [_as_dict(mine[i]) for i in range(len(mine))] == [_as_dict(theirs[i]) for i in range(len(theirs))]
    finally:
        mine.close()
        theirs.close()


@pytest.fixture(scope="module")
def packed_20k(tmp_path_factory) -> Path:
    """20,000 tiny JPEGs packed 1,000 a shard by the pack tool."""
    from distribuuuu.data.pack import PackOptions, pack_split

    root = tmp_path_factory.mktemp("packed")
    make_linked_folder(str(root / "src" / "train"), 20_000, 20)
    pack_split(str(root / "src"), "train", str(root / "packed"), PackOptions(shard_size=1000))
    return root / "packed"


def test_a_reader_holds_its_open_shards_in_at_most_16_bytes_a_sample(packed_20k, tmp_path):
    # A reader keeps every shard open (a global random order reads any of them at any step): wids's
    # index of an open shard held a dict entry, a tuple and a name for each file, 567 B a sample
    # here (375 B private in docs/design.md). Now an int64 a sample, and for each open shard its
    # mapped file and a few objects (< 1 KiB), which 1,000 samples a shard carry.
    from distribuuuu.data.packed import PackedDataset

    dataset = PackedDataset(str(packed_20k), "train", cache_dir=str(tmp_path / "links"))
    first_of_each_shard = range(0, len(dataset), 1000)
    _, held = retained_bytes(lambda: [dataset.encoded(i) for i in first_of_each_shard])
    assert len(dataset.shards.cache) == 20
    assert held <= 16 * len(dataset), f"the open shards hold {held / len(dataset):.1f} B a sample"
    reference = _reference(packed_20k.parent / "src" / "train")
    by_name = {os.path.relpath(p, packed_20k.parent / "src" / "train"): p for p, _ in reference.samples}
    for i in (0, 1, 999, 1000, 19_999):  # what the shards hold is each named file's bytes
        data, _, target = dataset.encoded(i)
        name = dataset.samples[i][0]
        assert data == Path(by_name[name]).read_bytes() and target == reference.class_to_idx[name.split("/")[0]]
