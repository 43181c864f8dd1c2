"""Argument checks shared by every module: one helper per rule, one wording per rule.

Why a module of its own: the same rule ("a positive integer, not a bool") was written by hand in
eight files and had drifted (numpy integers accepted in one place, refused in another).  Every
check here accepts Python and numpy integers alike, refuses ``bool`` (an ``int`` subclass that is
never meant as a count), names the argument, and raises the caller's error class so that each
layer keeps its own exception type (``MeshError``, ``DataProtoError``, ``BackendError`` ...).

This module imports nothing from the package.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np

ErrorType = type[Exception]


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (``True`` is not a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(value: Any, what: str, error: ErrorType = ValueError) -> int:
    """``value`` as an ``int`` >= 1, else ``error`` naming ``what``."""
    if not is_int(value) or value < 1:
        raise error(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_int(value: Any, what: str, error: ErrorType = ValueError) -> int:
    """``value`` as an ``int`` >= 0, else ``error`` naming ``what``."""
    if not is_int(value) or value < 0:
        raise error(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def int_in_range(value: Any, what: str, low: int, high: int, error: ErrorType = ValueError) -> int:
    """``value`` as an ``int`` with ``low <= value <= high`` (both ends included)."""
    if not is_int(value) or not low <= value <= high:
        raise error(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def integer(value: Any, what: str, error: ErrorType = ValueError) -> int:
    """``value`` as an ``int`` of any sign (a coordinate such as ``-1`` for "last")."""
    if not is_int(value):
        raise error(f"{what} must be an integer, got {value!r}")
    return int(value)


def positive_seconds(value: Any, what: str, error: ErrorType = ValueError) -> float:
    """A finite number of seconds > 0 (ints, floats and numpy numbers; not bools)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(float(value)) or not value > 0:
        raise error(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def optional_seconds(value: Any, what: str, error: ErrorType = ValueError) -> float | None:
    """``None`` (no limit) or :func:`positive_seconds`."""
    return None if value is None else positive_seconds(value, f"{what} (None for no limit)", error)


def node_labels(value: Any, what: str, error: ErrorType = ValueError) -> dict[str, str]:
    """Node labels to require: a ``{key: value}`` mapping of strings (``None``: none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(f"{what} must be a mapping of label keys to values, e.g. {{zone: us-east-1a}}, got {value!r}")
    out = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key:
            raise error(f"{what}: label keys must be non-empty strings, got {key!r}")
        if not isinstance(val, str):
            raise error(f"{what}.{key}: label values are strings, got {val!r}; quote it in a layout file ({key}: \"{val}\")")
        out[key] = val
    return out


def writable_file(value: Any, what: str, error: ErrorType = ValueError, *, make_folders: bool = False) -> str:
    """``value`` (a str or path) as a file path that can be written now; checked before any work, nothing created.

    Refused, naming ``what`` and the path: an empty path, an existing directory, a path under a
    file, a missing folder (unless ``make_folders``: the writer creates the missing folders, so the
    nearest existing one is checked instead), and a folder or file this process may not write.
    """
    try:
        path = os.fsdecode(os.fspath(value))
    except TypeError:
        raise error(f"{what} must be a file path (a str or os.PathLike), got {type(value).__name__}: {value!r}") from None
    if not path:
        raise error(f"{what} is empty; give the path of the file to write")
    if os.path.isdir(path):
        raise error(f"{what} {path!r} is a directory; give the path of a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.lexists(existing):  # the nearest folder that exists (``/`` always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise error(f"{what} {path!r}: {existing!r} is a file, not a directory")
    if existing != folder and not make_folders:
        raise error(f"{what} {path!r}: directory {folder!r} does not exist (create it first)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise error(f"{what} {path!r}: directory {existing!r} is not writable; choose another path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise error(f"{what} {path!r}: the file exists and is not writable; choose another path")
    return path
