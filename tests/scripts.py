"""The programs under scripts/ imported as modules, so tests call their functions in-process.

In-process calls reuse the session's Ray and cost no interpreter start; a script is still run
through a subprocess where the test is about how it starts (its own Ray, its exit code).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` as a module for the duration of a fixture (yield it; removed after)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
