"""Datasets listed in an annotation file: one image and its label(s) a line (docs/annotations.md).

A ``.csv`` file is comma-separated, a ``.tsv`` file tab-separated (both read by Python's ``csv``, so
quoted fields may hold the separator), any other file is whitespace-separated: the image path,
then the label field, and nothing more (a path holding a space needs a csv or tsv file). Image
paths are relative to the dataset root, or absolute. The label field is one class name, or, for
multi-label data, class names joined by a separator, or empty (an image of none of the classes).
Class indices are the class names in the order of a classes file (one name a line), or else the
names found, sorted as ImageFolder sorts its folders: an annotation file listing an ImageFolder's
samples in its order gives the very same dataset, targets included.

Every line is checked before training: a malformed line, an image that is not there or a label
the classes file does not list raises DataError naming the annotation file and its line.
"""

from __future__ import annotations

import csv
import os
from collections import Counter
from dataclasses import dataclass

from torch.utils.data import Dataset

from distribuuuu.data.encoded import load_image, read_image_file
from distribuuuu.data.errors import DataError
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS
from distribuuuu.data.index import Labels, Samples, Strings, Target


@dataclass(frozen=True)
class AnnotationSpec:
    """How to read an annotation file: its path (relative to the dataset root unless absolute),
    whether its first line is a header, a classes file ("": the labels found), and the separator of
    a multi-label field ("": one label a line)."""

    file: str
    header: bool = False
    classes_file: str = ""
    label_sep: str = ""


def read_annotations(root: str, spec: AnnotationSpec) -> tuple[list[tuple[str, Target]], list[str]]:
    """The (image path, target) samples the annotation file lists, in its order, and the class names."""
    samples, classes, _ = _read(root, spec)
    return samples, classes


def _read(root: str, spec: AnnotationSpec) -> tuple[list[tuple[str, Target]], list[str], dict[str, int]]:
    """read_annotations, and the line where each label first appears (for the messages of class matching)."""
    path = os.path.join(root, spec.file)
    if os.path.isdir(path):
        raise DataError(f"annotation file is a directory: {path}")
    if not os.path.isfile(path):
        raise DataError(f"annotation file not found: {path}")
    whitespace = os.path.splitext(path)[1].lower() not in (".csv", ".tsv")
    labelled = [
        (n, *_image_and_labels(path, n, fields, whitespace, spec.label_sep)) for n, fields in _rows(path, spec.header)
    ]
    if not labelled:
        raise DataError(f"{path}: no samples listed")
    first_lines: dict[str, int] = {}
    for n, _, labels in labelled:
        for label in labels:
            first_lines.setdefault(label, n)
    classes = _read_classes(root, spec.classes_file) if spec.classes_file else sorted(first_lines)
    if not classes:  # every line a multi-label negative: no class to train
        raise DataError(f"{path}: no line labels its image with a class")
    index = {name: i for i, name in enumerate(classes)}
    samples = []
    for lineno, image, labels in labelled:
        unknown = [label for label in labels if label not in index]
        if unknown:
            raise DataError(f"{path}:{lineno}: label {unknown[0]!r} is not in the classes file {spec.classes_file}")
        file = os.path.join(root, image)
        if not os.path.isfile(file):
            raise DataError(f"{path}:{lineno}: image not found: {_shown(file)}")
        indices = sorted({index[label] for label in labels})
        samples.append((file, tuple(indices) if spec.label_sep else indices[0]))
    return samples, classes, first_lines


def _rows(path: str, header: bool):
    """(line number, its stripped fields) for each non-blank line after the header."""
    suffix = os.path.splitext(path)[1].lower()
    # utf-8-sig: the byte-order mark Windows editors start a file with is no character of its first path
    with open(path, newline="", encoding="utf-8-sig") as f:
        if suffix in (".csv", ".tsv"):
            reader = csv.reader(f, delimiter="," if suffix == ".csv" else "\t")
            lines = ((reader.line_num, row) for row in reader)  # line_num: the row's (last) line
        else:
            lines = ((n, line.split()) for n, line in enumerate(f, 1))
        try:
            for n, fields in lines:
                fields = [x.strip() for x in fields]
                if (header and n == 1) or not any(fields):
                    continue
                yield n, fields
        except (csv.Error, UnicodeDecodeError) as e:
            raise DataError(f"{path}: unreadable annotation file: {e}") from None


def _image_and_labels(path: str, n: int, fields: list[str], whitespace: bool, sep: str) -> tuple[str, list[str]]:
    """A line's image path and labels: the path, then one label field, which may be empty (an image
    with no class, a negative) only in multi-label data (``sep`` set). In a whitespace-separated
    file whose labels are joined by whitespace too, every field after the path is a label."""
    image, rest = fields[0], fields[1:]
    if whitespace and sep.isspace():
        return image, rest
    if whitespace and len(rest) > 1:
        raise DataError(
            f"{path}:{n}: expected an image path and one label separated by whitespace, got {len(fields)} fields "
            f"{_clipped(fields)} (a path or label holding spaces needs a .csv or .tsv file, its fields quoted as needed)"
        )
    field = rest[0] if rest else ""
    complete = len(fields) == 2 or (whitespace and sep)  # a lone path in a whitespace file: the empty field
    if not image or not complete or not (field or sep):
        raise DataError(f"{path}:{n}: expected an image path and a label, got {_clipped(fields)}")
    return image, _labels(path, n, field, sep)


def _labels(path: str, lineno: int, field: str, sep: str) -> list[str]:
    """The class names of a label field: the field, or with ``sep`` the names it joins (none when empty)."""
    if not sep:
        return [field]
    if sep.isspace():
        return field.split()  # a run of whitespace is one separator
    labels = [label.strip() for label in field.split(sep)] if field else []
    if not all(labels):
        raise DataError(f"{path}:{lineno}: an empty label in {_clipped([field])[1:-1]} (labels joined by {sep!r})")
    return labels


def _clipped(fields: list[str], most: int = 200) -> str:
    """The fields as a message shows them: their repr, each cut to ``most`` characters (a line of a
    binary file can be megabytes long)."""
    return repr([f if len(f) <= most else f[:most] + "..." for f in fields])


def _shown(text: str) -> str:
    """``text`` as a message shows it: quoted when it holds a line break or another unprintable character."""
    return text if text.isprintable() else repr(text)


def _read_classes(root: str, classes_file: str) -> list[str]:
    path = os.path.join(root, classes_file)
    try:
        with open(path, encoding="utf-8-sig") as f:
            names = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"classes file unreadable: {path}: {e}") from None
    duplicated = sorted(name for name, count in Counter(names).items() if count > 1)
    if not names or duplicated:
        raise DataError(f"{path}: {'duplicated class names ' + str(duplicated) if names else 'no class names'}")
    return names


@dataclass(frozen=True)
class AnnotationIndex:
    """An annotation file's samples in arrays (data/index.py), its class names, and the line where
    each label first appears."""

    samples: Samples
    classes: list[str]
    label_lines: dict[str, int]


def read_annotation_index(root: str, spec: AnnotationSpec) -> AnnotationIndex:
    """The annotation file's samples, every line checked (read_annotations), held in arrays."""
    samples, classes, label_lines = _read(root, spec)
    paths = Strings.of(path for path, _ in samples)
    return AnnotationIndex(
        Samples(paths, Labels.of([t for _, t in samples], bool(spec.label_sep))), classes, label_lines
    )


class AnnotatedImages(Dataset):
    """The images an annotation file lists, shaped like CheckedImageFolder: ``samples`` (path, target),
    ``targets``, ``classes``, ``encoded`` (the batched decoder's input); ``label_lines``, the line
    where each label first appears, for the messages of class matching (data/classes.py). ``index``:
    the file already read (read_annotation_index; by one rank for all)."""

    def __init__(
        self,
        root: str,
        spec: AnnotationSpec,
        decoder: str = "auto",
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        index: AnnotationIndex | None = None,
    ):
        index = index if index is not None else read_annotation_index(root, spec)
        self.samples, self.classes, self.label_lines = index.samples, list(index.classes), dict(index.label_lines)
        self.targets = self.samples.labels
        self.decoder, self.max_pixels = decoder, max_pixels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        return load_image(path, self.decoder, self.max_pixels), target

    def encoded(self, index: int) -> tuple[bytes, str, Target]:
        """Sample ``index``'s file bytes, its path, its target."""
        path, target = self.samples[index]
        return read_image_file(path), path, target
