"""Finding layout files by name or path, and loading them (safe YAML only)."""

from __future__ import annotations

import logging
import os
import site
import sys
from importlib import resources
from pathlib import Path

import yaml

from rankmesh.errors import LayoutError, LayoutFileError, LayoutNotFoundError
from rankmesh.layout.checks import check_layout
from rankmesh.layout.parse import parse_layout
from rankmesh.layout.spec import LAYOUTS_ENV, SUFFIXES, Layout

log = logging.getLogger(__name__)


def layout_dirs() -> list[Path]:
    """Where layout names are looked up, first match wins.

    1. every directory in ``$RANKMESH_LAYOUTS`` (``os.pathsep``-separated);
    2. ``parallel_layouts/`` at the repository root (source checkout, editable install);
    3. ``<sys.prefix or user base>/share/rankmesh/parallel_layouts`` (installed as wheel data-files);
    4. ``rankmesh/parallel_layouts`` inside the package, if a build copied it there.
    """
    dirs = [Path(p) for p in os.environ.get(LAYOUTS_ENV, "").split(os.pathsep) if p]
    share = Path("share") / "rankmesh" / "parallel_layouts"
    candidates = [
        Path(__file__).resolve().parents[3] / "parallel_layouts",
        Path(sys.prefix) / share,
        Path(site.getuserbase()) / share,  # pip install --user
    ]
    try:
        packaged = resources.files("rankmesh") / "parallel_layouts"
        candidates.append(Path(str(packaged)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - zipped installs
        pass
    for candidate in candidates:
        if candidate.is_dir():
            dirs.append(candidate)
            break
    return dirs


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def list_layouts() -> list[str]:
    """Names (file stems) of every layout found in :func:`layout_dirs`, sorted."""
    names: set[str] = set()
    for directory in layout_dirs():
        if directory.is_dir():
            names.update(p.stem for p in directory.iterdir() if p.suffix in SUFFIXES and p.is_file())
    return sorted(names)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(SUFFIXES)


def find_layout(name_or_path: str | os.PathLike[str]) -> Path:
    """The file for a layout name (``cpu_demo`` or ``cpu-demo``) or a path to a YAML file."""
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text) or Path(text).exists():
        path = Path(text)
        if path.is_file():
            return path
        if path.is_dir():
            raise LayoutNotFoundError(f"{text}: is a directory, not a layout file (give a .yaml file in it, or a layout name)")
        if isinstance(name_or_path, os.PathLike) or "/" in text or os.sep in text or path.suffix not in SUFFIXES:
            raise LayoutNotFoundError(f"{text}: no such layout file")
        text = path.stem  # a bare file name such as cpu_demo.yaml: look it up like a name
    wanted = _normalize(text)
    for directory in layout_dirs():
        for suffix in SUFFIXES:
            path = directory / f"{wanted}{suffix}"
            if path.is_file():
                return path
    known = ", ".join(list_layouts()) or "none found"
    raise LayoutNotFoundError(f"unknown layout {text!r} (known layouts: {known}; or give a path to a .yaml file)")


def load_layout(name_or_path: str | os.PathLike[str], *, check: bool = True) -> Layout:
    """Load a layout by name or path.

    ``check=True`` also raises if :func:`validate_layout` finds an error (warnings pass);
    ``check=False`` returns any structurally sound layout, for reporting.  A name or path that finds
    no file raises :class:`LayoutNotFoundError`; a file found but not a valid layout,
    :class:`LayoutFileError` (both are :class:`LayoutError`).
    """
    path = find_layout(name_or_path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutFileError(f"{source}: cannot read: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LayoutFileError(f"{source}: malformed YAML: {_yaml_message(exc)}") from exc
    try:
        layout = parse_layout(data, source)
        log.debug("loaded layout %s from %s", layout.name, source)
        return check_layout(layout) if check else layout
    except LayoutError as exc:  # the text already names the file, role and field
        raise LayoutFileError(str(exc)) from exc


def _yaml_message(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
