"""Datasets listed in an annotation file: one image and its label(s) a line (docs/annotations.md).

A ``.csv`` file is comma-separated, a ``.tsv`` file tab-separated (both read by Python's ``csv``, so
quoted fields may hold the separator), any other file is whitespace-separated: the image path,
then the label field. Image paths are relative to the dataset root, or absolute. The label field
is one class name, or, for multi-label data, class names joined by a separator. Class indices are
the class names in the order of a classes file (one name a line), or else the names found, sorted
as ImageFolder sorts its folders: an annotation file listing an ImageFolder's samples in its order
gives the very same dataset, targets included.

Every line is checked before training: a malformed line, an image that is not there or a label
the classes file does not list raises DataError naming the annotation file and its line.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

from torch.utils.data import Dataset

from distribuuuu.data.encoded import load_image, read_image_file
from distribuuuu.data.errors import DataError
from distribuuuu.data.image_size import DEFAULT_MAX_IMAGE_PIXELS

Target = int | tuple[int, ...]  # a class index, or the sorted class indices of a multi-label sample


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
    path = os.path.join(root, spec.file)
    if not os.path.isfile(path):
        raise DataError(f"annotation file not found: {path}")
    rows = list(_rows(path, spec.header))
    classes = _read_classes(root, spec.classes_file) if spec.classes_file else None
    labelled = [(lineno, image, _labels(path, lineno, field, spec.label_sep)) for lineno, image, field in rows]
    if not labelled:
        raise DataError(f"{path}: no samples listed")
    if classes is None:
        classes = sorted({label for _, _, labels in labelled for label in labels})
    index = {name: i for i, name in enumerate(classes)}
    samples = []
    for lineno, image, labels in labelled:
        unknown = [label for label in labels if label not in index]
        if unknown:
            raise DataError(f"{path}:{lineno}: label {unknown[0]!r} is not in the classes file {spec.classes_file}")
        file = os.path.join(root, image)
        if not os.path.isfile(file):
            raise DataError(f"{path}:{lineno}: image not found: {file}")
        indices = sorted({index[label] for label in labels})
        samples.append((file, tuple(indices) if spec.label_sep else indices[0]))
    return samples, classes


def _rows(path: str, header: bool):
    """(line number, image, label field) for each non-blank line after the header."""
    suffix = os.path.splitext(path)[1].lower()
    with open(path, newline="", encoding="utf-8") as f:
        if suffix in (".csv", ".tsv"):
            reader = csv.reader(f, delimiter="," if suffix == ".csv" else "\t")
            lines = ((reader.line_num, row) for row in reader)  # line_num: the row's (last) line
        else:
            lines = ((n, line.split(None, 1)) for n, line in enumerate(f, 1))
        try:
            for n, fields in lines:
                if header and n == 1:
                    continue
                fields = [x.strip() for x in fields]
                if not any(fields):
                    continue
                if len(fields) != 2 or not all(fields):
                    raise DataError(f"{path}:{n}: expected an image path and a label, got {fields!r}")
                yield n, fields[0], fields[1]
        except (csv.Error, UnicodeDecodeError) as e:
            raise DataError(f"{path}: unreadable annotation file: {e}") from None


def _labels(path: str, lineno: int, field: str, sep: str) -> list[str]:
    labels = [label.strip() for label in field.split(sep)] if sep else [field]
    if not all(labels):
        raise DataError(f"{path}:{lineno}: an empty label in {field!r} (labels joined by {sep!r})")
    return labels


def _read_classes(root: str, classes_file: str) -> list[str]:
    path = os.path.join(root, classes_file)
    try:
        with open(path, encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip()]
    except OSError as e:
        raise DataError(f"classes file unreadable: {path}: {e}") from None
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if not names or duplicated:
        raise DataError(f"{path}: {'duplicated class names ' + str(duplicated) if names else 'no class names'}")
    return names


class AnnotatedImages(Dataset):
    """The images an annotation file lists, shaped like CheckedImageFolder: ``samples`` (path, target),
    ``targets``, ``classes``, ``encoded`` (the batched decoder's input)."""

    def __init__(
        self, root: str, spec: AnnotationSpec, decoder: str = "auto", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    ):
        self.samples, self.classes = read_annotations(root, spec)
        self.targets = [t for _, t in self.samples]
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
