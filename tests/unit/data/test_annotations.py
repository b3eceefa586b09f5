"""Datasets listed in annotation files: an annotation-file copy of the digits is the ImageFolder
dataset to the last bit (samples, batches, trained weights), with every sampler and decoder, as the
val split and the extra ones, and packed; a bad line stops the run naming the file and the line."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from helpers import EVAL_TINY, REPO, TINY_TRAIN, _without_timings, assert_ok, in_process, read_metrics, truncated_jpeg
from PIL import Image

from distribuuuu import cli, trainer
from distribuuuu.checkpointing import checkpoint as ckpt
from distribuuuu.checkpointing.checkpoint import load_checkpoint, model_state_from
from distribuuuu.config import load_cfg
from distribuuuu.data import DataError
from distribuuuu.data.annotations import AnnotationSpec, read_annotations
from distribuuuu.data.readers import build_base_dataset
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.training.inputs import build_train_split, build_val_split

DIGITS = REPO / "data" / "digits"
# In-process runs on one thread: they run beside the background jobs (tests/background.py).
pytestmark = pytest.mark.usefixtures("plain_logging")


def write_annotations(root: Path, split: str, path: Path, header: bool = True) -> Path:
    """An annotation file listing ``root``/``split``'s ImageFolder samples in its order (paths relative to root)."""
    base, classes = build_base_dataset(str(root), split)
    delimiter = "\t" if path.suffix == ".tsv" else ","
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        if header:
            writer.writerow(["image", "label"])
        writer.writerows((os.path.relpath(p, root), classes[t]) for p, t in base.samples)
    return path


@pytest.fixture(scope="module")
def small_digits(tmp_path_factory) -> tuple[Path, tuple[Path, Path]]:
    """A digits subset (12 train, 4 val images a class, linked) and its train.csv and val.tsv."""
    root = tmp_path_factory.mktemp("small")
    for split, n in (("train", 12), ("val", 4)):
        for c in range(10):
            (root / split / str(c)).mkdir(parents=True)
            for png in sorted((DIGITS / split / str(c)).glob("*.png"))[:n]:
                (root / split / str(c) / png.name).symlink_to(png)
    return root, (
        write_annotations(root, "train", root / "train.csv"),
        write_annotations(root, "val", root / "val.tsv"),
    )


def _annotated(files: tuple[Path, Path]) -> list[str]:
    return ["TRAIN.ANN_FILE", str(files[0]), "TEST.ANN_FILE", str(files[1]), "DATA.ANN_HEADER", "True"]


def test_an_annotation_file_lists_the_image_folders_samples_and_classes(small_digits):
    root, files = small_digits
    folder, classes = build_base_dataset(str(root), "train")
    samples, ann_classes = read_annotations(str(root), AnnotationSpec("train.csv", header=True))
    assert ann_classes == classes and samples == folder.samples


@pytest.mark.parametrize(
    "sampler, decoder", [("default", "auto"), ("repeated", "auto"), ("weighted", "auto"), ("default", "batched")]
)
def test_annotation_batches_equal_image_folder_batches_for_every_sampler(small_digits, sampler, decoder):
    root, files = small_digits

    def first_batches(*extra: str) -> tuple[list, list]:
        opts = ["TRAIN.SAMPLER", sampler, "DATA.DECODER", decoder, "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16"]
        opts += ["TRAIN.DATASET", str(root), "TEST.DATASET", str(root), "DATA.AUTO_AUGMENT", "trivialaugment"]
        cfg = load_cfg(None, [*opts, *extra])
        train, val = build_train_split(cfg, DistEnv()), build_val_split(cfg, DistEnv())
        train.sampler.set_epoch(1)
        return [b for _, b in zip(range(2), train.loader)], list(val.loader)

    for expected, got in zip(first_batches(), first_batches(*_annotated(files))):
        assert len(expected) == len(got)
        for (x, y, dropped), (x2, y2, dropped2) in zip(expected, got):
            assert torch.equal(x, x2) and torch.equal(y, y2) and dropped == dropped2


def _run(out: Path, *extra: str) -> None:
    opts = [*EVAL_TINY, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "16", *extra]
    assert_ok(in_process(TINY_TRAIN, *opts))


@pytest.mark.slow
def test_annotation_copy_of_digits_trains_bit_identically_to_the_image_folder(small_digits, tmp_path):
    root, files = small_digits
    # An extra val set at another root: the annotation file's paths are read relative to each root.
    (tmp_path / "again").symlink_to(root)
    extra = ["TRAIN.DATASET", str(root), "TEST.DATASET", str(root), "TEST.EXTRA_DATASETS", f"['{tmp_path / 'again'}']"]
    _run(tmp_path / "folder", *extra)
    _run(tmp_path / "ann", *extra, *_annotated(files))
    weights = [
        model_state_from(load_checkpoint(str(tmp_path / r / ckpt.CKPT_DIR / ckpt.checkpoint_name(1))))
        for r in ("folder", "ann")
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    records = [[_without_timings(r) for r in read_metrics(tmp_path / d)] for d in ("folder", "ann")]
    vals = [r for r in records[1] if r.get("split", "").startswith("val")]
    assert {r["split"] for r in vals} == {"val", "val_again"}
    assert records[0] == records[1]


def _first_image(split: str, c: int) -> Path:
    return min((DIGITS / split / str(c)).glob("*.png"))


BAD_LINES = [
    ("train/0/0000.png\n", 1, "expected an image path and a label"),
    ("train/0/0000.png,0\ntrain/0/0010.png,0,extra\n", 2, "expected an image path and a label"),
    ("train/0/0000.png,0\n\ntrain/0/nothere.png,0\n", 3, "image not found"),
    ("train/0/0000.png,0\ntrain/0/0010.png,eleven\n", 2, "label 'eleven' is not in the classes file"),
    ("train/0/0000.png,\n", 1, "expected an image path and a label"),
]


@pytest.mark.parametrize("content, lineno, what", BAD_LINES)
def test_a_bad_line_names_the_annotation_file_and_its_line(tmp_path, content, lineno, what):
    (tmp_path / "bad.csv").write_text(content)
    (tmp_path / "classes.txt").write_text("\n".join(str(i) for i in range(10)) + "\n")
    spec = AnnotationSpec(str(tmp_path / "bad.csv"), classes_file=str(tmp_path / "classes.txt"))
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.csv'}:{lineno}: {what}"):
        read_annotations(str(DIGITS), spec)


def test_a_bad_annotation_file_stops_the_run_with_one_line_before_training(tmp_path, capsys):
    (tmp_path / "train.txt").write_text("train/0/0000.png 0\ntrain/1/0010.png\n")
    out = tmp_path / "out"
    args = [*EVAL_TINY, "OUT_DIR", str(out), "TRAIN.ANN_FILE", str(tmp_path / "train.txt")]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_BAD_INPUT
    assert not (out / "metrics.jsonl").exists()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distribuuuu: error:")]
    assert errors == [
        f"distribuuuu: error: {tmp_path / 'train.txt'}:2: expected an image path and a label, got ['train/1/0010.png']"
    ]
    missing = [*EVAL_TINY, "OUT_DIR", str(out), "TEST.DATASET", str(DIGITS), "TEST.ANN_FILE", "nothere.csv"]
    assert cli.run_tool(trainer.train_model, missing) == cli.EXIT_BAD_INPUT
    assert f"TEST.ANN_FILE: annotation file not found: {DIGITS / 'nothere.csv'}" in capsys.readouterr().err


def test_text_files_absolute_paths_quoted_fields_and_classes_files(tmp_path):
    image = _first_image("train", 3)
    (tmp_path / "a,b.png").symlink_to(image)
    (tmp_path / "list.txt").write_text(f"{image}   three\n\n  a,b.png\tone  \n")
    (tmp_path / "list.csv").write_text(f'path,label\n"a,b.png",one\n{image},three\n')
    (tmp_path / "names.txt").write_text("three\none\ntwo\n")
    samples, classes = read_annotations(str(tmp_path), AnnotationSpec("list.txt"))
    assert classes == ["one", "three"] and samples == [(str(image), 1), (str(tmp_path / "a,b.png"), 0)]
    samples, classes = read_annotations(str(tmp_path), AnnotationSpec("list.csv", True, str(tmp_path / "names.txt")))
    assert classes == ["three", "one", "two"] and samples == [(str(tmp_path / "a,b.png"), 1), (str(image), 0)]


def test_an_unreadable_listed_image_is_skipped_and_counted_with_bad_image_skip(tmp_path):
    bad = truncated_jpeg(tmp_path / "broken.jpg")
    lines = [f"{_first_image('train', c)},{c}" for c in range(10)] + [f"{bad},3"]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    opts = ["TRAIN.DATASET", str(tmp_path), "TRAIN.ANN_FILE", "train.csv", "TRAIN.BATCH_SIZE", "11"]
    cfg = load_cfg(None, [*opts, "DATA.BAD_IMAGE", "skip"])
    [(images, targets, dropped)] = list(build_train_split(cfg, DistEnv()).loader)
    assert len(images) == 10 and dropped == 1


def test_pack_tool_packs_an_annotation_file_with_its_targets(small_digits, tmp_path):
    from distribuuuu.data.packed import PackedDataset

    pytest.importorskip("webdataset")
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(reversed([str(i) for i in range(10)])) + "\n")  # indices 9..0
    tool = str(REPO / "tools" / "pack_dataset.py")
    root, files = small_digits
    args = [str(root), str(tmp_path / "packed"), "--splits", "train,val", "--shard-size", "50"]
    args += ["--ann-files", "train.csv,val.tsv", "--ann-header", "--ann-classes", str(names)]
    result = in_process(tool, *args)
    assert result.returncode == 0, result.stderr
    for split, file in zip(("train", "val"), files):
        listed, classes = read_annotations(str(root), AnnotationSpec(str(file), True, str(names)))
        packed = PackedDataset(str(tmp_path / "packed"), split, cache_dir=str(tmp_path / "cache"))
        assert packed.classes == classes == [str(i) for i in range(9, -1, -1)]
        by_name = dict(packed.samples)
        assert len(by_name) == len(listed)
        assert all(by_name[os.path.relpath(p, root)] == t for p, t in listed)
        image, target = packed[0]
        assert image.size == Image.open(root / packed.samples[0][0]).size and target == by_name[packed.samples[0][0]]


def _digit_lines(sep: str = ",") -> list[str]:
    return [f"train/{c}/{_first_image('train', c).name}{sep}{c}" for c in range(10)]


@pytest.mark.parametrize("name", ["list.csv", "list.txt"])
def test_a_utf8_bom_before_a_headerless_file_is_no_part_of_its_first_path(tmp_path, name):
    # Windows editors (Notepad, Excel's "CSV UTF-8") start a file with U+FEFF: it is no character of the path.
    (tmp_path / name).write_bytes(
        "\ufeff".encode() + "\n".join(_digit_lines("," if name.endswith("csv") else " ")).encode()
    )
    (tmp_path / "classes.txt").write_bytes("\ufeff".encode() + "\n".join(str(c) for c in range(10)).encode())
    samples, classes = read_annotations(str(DIGITS), AnnotationSpec(str(tmp_path / name)))
    assert samples[0] == (str(_first_image("train", 0)), 0) and classes == [str(c) for c in range(10)]
    spec = AnnotationSpec(str(tmp_path / name), classes_file=str(tmp_path / "classes.txt"))
    assert read_annotations(str(DIGITS), spec) == (samples, classes)


@pytest.mark.parametrize(
    "line",
    ["train/0/my image.png 0", "train/0/0000.png 0 extra"],
    ids=["a-space-in-the-path", "a-third-field"],
)
def test_a_whitespace_line_with_more_than_two_fields_is_refused_naming_its_line(tmp_path, line):
    # Read as path then label, "my image.png 0" was the image "my" (not found) and "0 extra" a class.
    (tmp_path / "list.txt").write_text("\n".join([*_digit_lines(" ")[:2], line]) + "\n")
    fields = line.split()
    with pytest.raises(DataError) as refused:
        read_annotations(str(DIGITS), AnnotationSpec(str(tmp_path / "list.txt")))
    assert str(refused.value) == (
        f"{tmp_path / 'list.txt'}:3: expected an image path and one label separated by whitespace, got "
        f"{len(fields)} fields {fields!r} (a path or label holding spaces needs a .csv or .tsv file, its fields "
        "quoted as needed)"
    )


def test_a_directory_as_the_annotation_file_is_named_a_directory(tmp_path, capsys):
    (tmp_path / "train.csv").mkdir()
    with pytest.raises(DataError, match=f"^annotation file is a directory: {tmp_path / 'train.csv'}$"):
        read_annotations(str(tmp_path), AnnotationSpec("train.csv"))
    args = [*EVAL_TINY, "OUT_DIR", str(tmp_path / "out"), "TRAIN.DATASET", str(tmp_path), "TRAIN.ANN_FILE", "train.csv"]
    assert cli.run_tool(trainer.train_model, args) == cli.EXIT_BAD_INPUT
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distribuuuu: error:")]
    assert errors == [f"distribuuuu: error: TRAIN.ANN_FILE: annotation file is a directory: {tmp_path / 'train.csv'}"]


def test_a_val_label_outside_the_training_classes_names_the_file_and_line(tmp_path):
    (tmp_path / "train.csv").write_text("\n".join(_digit_lines()) + "\n")
    val = [f"val/{c}/{_first_image('val', c).name},{c}" for c in range(10)]
    val[4] = f"val/4/{_first_image('val', 4).name},four"
    (tmp_path / "val.csv").write_text("image,label\n" + "\n".join(val) + "\n")
    opts = ["TRAIN.DATASET", str(DIGITS), "TEST.DATASET", str(DIGITS), "DATA.ANN_HEADER", "False"]
    opts += [
        "TRAIN.BATCH_SIZE",
        "5",
        "TRAIN.ANN_FILE",
        str(tmp_path / "train.csv"),
        "TEST.ANN_FILE",
        str(tmp_path / "val.csv"),
    ]
    classes = build_train_split(load_cfg(None, opts), DistEnv()).classes
    with pytest.raises(DataError) as refused:
        build_val_split(load_cfg(None, [*opts, "DATA.ANN_HEADER", "True"]), DistEnv(), classes)
    assert str(refused.value) == (
        f"{tmp_path / 'val.csv'}:6: label 'four' is not one of the model's classes (labels not among them: "
        "['four']; no line labels ['4']); set TEST.CLASS_OVERLAP True to evaluate the classes both have"
    )


def test_a_multilabel_line_may_have_an_empty_label_field_a_negative_image(tmp_path):
    paths = [f"train/{c}/{_first_image('train', c).name}" for c in range(3)]
    (tmp_path / "list.csv").write_text(f"{paths[0]},0 2\n{paths[1]},\n{paths[2]},1\n")
    (tmp_path / "list.txt").write_text(f"{paths[0]} 0 2\n{paths[1]}\n{paths[2]}  1\n")
    (tmp_path / "semicolons.txt").write_text(f"{paths[0]} 0;2\n{paths[1]}\n{paths[2]} 1\n")
    expected = [(str(DIGITS / p), t) for p, t in zip(paths, [(0, 2), (), (1,)])]
    for name, sep in (("list.csv", " "), ("list.txt", " "), ("semicolons.txt", ";")):
        assert read_annotations(str(DIGITS), AnnotationSpec(str(tmp_path / name), label_sep=sep)) == (
            expected,
            ["0", "1", "2"],
        ), name
    # As a run reads it: the negative's target is the all-zero row.
    opts = ["TRAIN.DATASET", str(DIGITS), "TRAIN.ANN_FILE", str(tmp_path / "list.csv"), "MODEL.TASK", "multilabel"]
    opts += ["MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "1", "TRAIN.BATCH_SIZE", "3", "TRAIN.SAMPLER", "default"]
    split = build_train_split(load_cfg(None, opts), DistEnv())
    rows = {tuple(target.tolist()) for _, targets, _ in split.loader for target in targets}
    assert rows == {(1.0, 0.0, 1.0), (0.0, 0.0, 0.0), (0.0, 1.0, 0.0)}
    # A single-label file still needs its label, and a multi-label file some label somewhere.
    with pytest.raises(DataError, match=r":2: expected an image path and a label, got \["):
        read_annotations(str(DIGITS), AnnotationSpec(str(tmp_path / "list.csv")))
    (tmp_path / "none.csv").write_text(f"{paths[0]},\n")
    with pytest.raises(DataError, match=f"^{tmp_path / 'none.csv'}: no line labels its image with a class$"):
        read_annotations(str(DIGITS), AnnotationSpec(str(tmp_path / "none.csv"), label_sep=" "))
