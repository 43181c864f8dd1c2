"""Lazy module attributes: names a package lists but imports only when first used.

Why: ``import rankmesh`` must not import Ray, and ``import rankmesh.megatron`` must not import
megatron-core, yet both packages should show those names in ``dir()`` and resolve them on first
attribute access.  One helper builds the module-level ``__getattr__`` and ``__dir__`` pair (PEP
562) for every package that needs it.

This module imports nothing from the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``; ``exports`` maps a name to its module's path.

    A resolved name is cached in ``namespace`` (the package's ``globals()``), so each import
    happens once.  Use it as::

        __getattr__, __dir__ = lazy_exports(__name__, {"RayWorkerGroup": "rankmesh.backends.ray.group"}, globals())
    """
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
