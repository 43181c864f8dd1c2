"""Weight resharding between two worker groups' meshes (e.g. a trainer's tp2·pp2·dp2 to a generator's tp1·dp8).

* :func:`plan_reshard`, :class:`ParamLayout`, :class:`ReshardPlan`, :class:`Transfer`: the pure
  planner (:mod:`rankmesh.reshard.plan`; no Ray, torch or megatron-core).
* :class:`ReshardWorker`, :func:`reshard`, :func:`plan_between`: running a plan on Ray
  (:mod:`rankmesh.reshard.execute`), loaded on first use.
"""

from __future__ import annotations

from rankmesh.lazy import lazy_exports
from rankmesh.reshard.plan import (
    ParamLayout,
    ReshardError,
    ReshardPlan,
    Transfer,
    local_shape,
    merge_layouts,
    plan_reshard,
    shard_intervals,
)

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ReshardWorker": "rankmesh.reshard.execute",
        "reshard": "rankmesh.reshard.execute",
        "plan_between": "rankmesh.reshard.execute",
        "layouts_from_module": "rankmesh.reshard.execute",
    },
    globals(),
)

__all__ = [
    "ParamLayout",
    "ReshardError",
    "ReshardPlan",
    "ReshardWorker",
    "Transfer",
    "layouts_from_module",
    "local_shape",
    "merge_layouts",
    "plan_between",
    "plan_reshard",
    "reshard",
    "shard_intervals",
]
