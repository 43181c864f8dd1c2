"""tensordict on first use: building TensorDicts and recognising them without importing tensordict early.

Why: importing tensordict imports ``torch._dynamo`` (tensordict wraps functions with
``torch.compiler`` hooks at import time).  Measured on the 2-core test machine, that is about
1.0 CPU-second of a plain worker process's 2.2 (a Ray actor boots in 0.3 and ``import torch``
takes 0.8): half of what every rank of a group spends before it does anything.  A process that
never builds or receives a TensorDict (a worker fed plain tensors, the ``rankmesh`` command, a
controller that only lays out meshes) should not pay it.  So rankmesh reaches tensordict only
through this module:

* :func:`is_tensordict` answers "is this a TensorDict?" without importing anything: while
  tensordict is not imported, no object can be one.  A TensorDict that arrives in a message
  imports tensordict as it is unpickled, so the check stays exact.
* :func:`new_tensordict` (and :func:`module` for the non-tensor wrappers) import it the first
  time a TensorDict is built.

Type annotations name ``TensorDict``/``TensorDictBase`` under ``TYPE_CHECKING`` only.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensordict import TensorDict

#: The import name this module defers (and looks up in ``sys.modules``).
TENSORDICT = "tensordict"


def module() -> ModuleType:
    """The tensordict module, imported now if this process has not imported it yet."""
    loaded = sys.modules.get(TENSORDICT)
    if loaded is None:
        import tensordict as loaded
    return loaded


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (any ``TensorDictBase``), without importing tensordict."""
    loaded = sys.modules.get(TENSORDICT)
    base = getattr(loaded, "TensorDictBase", None)  # None while tensordict is half-imported
    return base is not None and isinstance(value, base)


def new_tensordict(source: Any, batch_size: Any, device: Any = None) -> TensorDict:
    """``TensorDict(source, batch_size=..., device=...)``, importing tensordict on first use."""
    return module().TensorDict(source, batch_size=batch_size, device=device)
