"""Weight resharding between two worker groups' meshes (e.g. a trainer's tp2·pp2·dp2 to a generator's tp1·dp8).

* :func:`plan_reshard`, :class:`ParamLayout`, :class:`ReshardPlan`, :class:`Transfer`: the pure
  planner (:mod:`rankmesh.reshard.plan`; no Ray, torch or megatron-core).
* :class:`ReshardWorker` (:mod:`rankmesh.reshard.worker`): the worker methods that send and
  receive regions, on any backend (the backend's objects come from the worker's context);
* :func:`reshard`, :func:`plan_between`, :class:`ReshardStats`, :class:`ReshardSession`
  (:mod:`rankmesh.reshard.run`): the controller side, through the groups' ``call_ranks``.

The last two are loaded on first use: the planner stays importable without torch.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from rankmesh.errors import ReshardError
from rankmesh.lazy import lazy_exports
from rankmesh.reshard.plan import (
    ParamLayout,
    ReshardPlan,
    Transfer,
    local_shape,
    merge_layouts,
    plan_reshard,
    shard_intervals,
)

_EXPORTS: Mapping[str, str] = MappingProxyType({
    "ReshardWorker": "rankmesh.reshard.worker",
    "reshard": "rankmesh.reshard.run",
    "plan_between": "rankmesh.reshard.run",
    "ReshardStats": "rankmesh.reshard.run",
    "ReshardSession": "rankmesh.reshard.run",
})

__all__ = [
    "ParamLayout",
    "ReshardError",
    "ReshardPlan",
    "Transfer",
    "local_shape",
    "merge_layouts",
    "plan_reshard",
    "shard_intervals",
    *_EXPORTS,
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
