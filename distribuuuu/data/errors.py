"""The data errors every reader raises: a dataset that is not there or not right, an image that does not decode."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset is missing, empty or inconsistent; the message names the path."""


class BadImageError(RuntimeError):
    """An image file could not be decoded; the message names its path."""
