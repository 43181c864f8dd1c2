"""verl's auto-padding switch: the one piece of global mutable state the data layer keeps.

verl lets a program allow uneven chunks (and padding in the dispatch layer) either globally,
``DataProtoConfig.auto_padding = True`` (or the environment variable ``VERL_AUTO_PADDING``), or
per batch, ``meta_info["_verl_auto_padding"] = True``.  Both spellings are kept so ported worker
code behaves the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: meta_info key that enables padding for one batch (verl's name, kept for compatibility).
AUTO_PADDING_KEY = "_verl_auto_padding"

#: Environment variable that, set to "1"/"true", enables padding globally (verl's name).
AUTO_PADDING_ENV = "VERL_AUTO_PADDING"


class _DataProtoConfigMeta(type):
    """Metaclass so ``DataProtoConfig.auto_padding`` is a checked class-level property."""

    _auto_padding: bool = False
    auto_padding_key: str = AUTO_PADDING_KEY

    @property
    def auto_padding(cls) -> bool:
        from_env = os.getenv(AUTO_PADDING_ENV, "").strip().upper() in ("1", "TRUE")
        return from_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global switch: ``DataProtoConfig.auto_padding = True`` allows uneven chunking everywhere."""


def auto_padding_enabled(data: Any) -> bool:
    """Whether ``data`` (a DataProto, or its meta_info mapping) may be chunked unevenly."""
    meta = data if isinstance(data, Mapping) else getattr(data, "meta_info", None) or {}
    return bool(meta.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding
