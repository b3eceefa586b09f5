"""The data errors every reader raises: a dataset that is not there or not right, an image that does not decode."""

from __future__ import annotations

import importlib
from types import ModuleType


class DataError(ValueError):
    """A dataset is missing, empty or inconsistent; the message names the path."""


class BadImageError(RuntimeError):
    """An image file could not be decoded; the message names its path."""


class DeviceMemoryError(RuntimeError):
    """The device ran out of memory for one image alone (decoded or resampled); the message names its size."""


def import_extra(module: str, what: str, extra: str) -> ModuleType:
    """``module``, or a DataError naming ``what`` needs it and the extra that installs it. An
    installed module that fails to import (a dependency of its own missing) keeps its own error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise DataError(f"{what} needs {module}: pip install 'distribuuuu[{extra}]'") from None
