"""Classes by name: map an evaluation folder's classes onto the classes a model was trained on.

ImageFolder numbers class folders in the order of their names sorted as strings. That order is
the model's only where the folder holds exactly the training names: a test set whose folders are
numbered ``0``..``999`` (ImageNet-V2's layout, indices into the training classes) sorts as 0, 1,
10, 100, ... and would score against scrambled labels without a word. So targets are always
re-mapped by name here, numeric folder names that are not class names are read as indices, and
any other difference is an error (or, on request, the overlap is evaluated).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch.utils.data import Dataset

from distribuuuu.data.errors import DataError

logger = logging.getLogger("distribuuuu.data")


def map_classes(
    folder: list[str],
    model: list[str],
    overlap: bool = False,
    where: str = "",
    label_lines: Mapping[str, int] | None = None,
) -> dict[int, int]:
    """For each of the folder's class indices, the model's class index of the same class.

    By name when every folder name is a model class; else, when every name is a number below the
    model's class count, as that index. Folders the model does not know, or a folder that lacks
    some of the model's classes, raise DataError unless ``overlap``: then only the classes both
    have are evaluated. ``label_lines``: the classes are an annotation file's labels (``where``),
    and the line where each first appears, which the messages name.
    """
    what = "class folders" if label_lines is None else "labels"
    index = {name: i for i, name in enumerate(model)}
    if not set(folder) <= set(index) and all(n.isdigit() and int(n) < len(model) for n in folder):
        logger.info("%s: %s are numbers, read as indices into the model's %d classes", where, what, len(model))
        index = {str(i): i for i in range(len(model))}
    unknown = [n for n in folder if n not in index]
    known = {index[n] for n in folder if n in index}
    missing = [name for i, name in enumerate(model) if i not in known]
    if (unknown or missing) and not overlap:
        raise DataError(_mismatch(where, unknown, missing, label_lines))
    if unknown:
        logger.warning("%s: leaving out %d %s the model does not know: %s", where, len(unknown), what, unknown[:8])
    return {i: index[name] for i, name in enumerate(folder) if name in index}


def remap_targets(dataset: Dataset, mapping: dict[int, int]) -> None:
    """Rewrite a reader's (or CIFAR's) targets in place through ``mapping``; drop unmapped samples
    (a multi-label sample keeps the classes it maps)."""
    if all(k == v for k, v in mapping.items()) and len(mapping) == len(dataset.classes):
        return
    if hasattr(dataset, "samples"):  # the readers' arrays (data/index.py): __getitem__ reads samples
        dataset.samples = dataset.samples.mapped(mapping)
        dataset.targets = dataset.samples.labels
        if hasattr(dataset, "imgs"):  # ImageFolder's other name for its samples
            dataset.imgs = dataset.samples
        return
    keep = [i for i, t in enumerate(dataset.targets) if t in mapping]
    if len(keep) != len(dataset.targets):
        dataset.data = dataset.data[keep]
    dataset.targets = [mapping[dataset.targets[i]] for i in keep]


def _mismatch(where: str, unknown: list[str], missing: list[str], label_lines: Mapping[str, int] | None) -> str:
    """What a split whose classes differ from the model's is told: an annotation file's first line
    with an unknown label, or the class folders (or labels) on either side."""
    overlap = "set TEST.CLASS_OVERLAP True to evaluate the classes both have"
    if label_lines is None:
        return (
            f"{where}: class folders differ from the model's classes: "
            f"not among the model's {_names(unknown)}, no folder for {_names(missing)}; {overlap}"
        )
    lacking = f"no line labels {_names(missing)}"
    if not unknown:
        return f"{where}: {lacking} (the model's classes); {overlap}"
    first = min(unknown, key=lambda label: label_lines[label])
    return (
        f"{where}:{label_lines[first]}: label {first!r} is not one of the model's classes (labels not among "
        f"them: {_names(unknown)}{'; ' + lacking if missing else ''}); {overlap}"
    )


def _names(names: list[str]) -> str:
    return str(names[:8])[:-1] + (", ...]" if len(names) > 8 else "]")
