"""Weight resharding between two worker groups' meshes (e.g. a trainer's tp2·pp2·dp2 to a generator's tp1·dp8).

* :func:`plan_reshard`, :class:`ParamLayout`, :class:`ReshardPlan`, :class:`Transfer`: the pure
  planner (:mod:`rankmesh.reshard.plan`; no Ray, torch or megatron-core).
* running a plan on Ray (:class:`ReshardWorker`, :func:`reshard`, :func:`plan_between`) is the Ray
  backend's job: :mod:`rankmesh.backends.ray.reshard`, exported by :mod:`rankmesh.backends.ray`.
"""

from __future__ import annotations

from rankmesh.errors import ReshardError
from rankmesh.reshard.plan import (
    ParamLayout,
    ReshardPlan,
    Transfer,
    local_shape,
    merge_layouts,
    plan_reshard,
    shard_intervals,
)

__all__ = [
    "ParamLayout",
    "ReshardError",
    "ReshardPlan",
    "Transfer",
    "local_shape",
    "merge_layouts",
    "plan_reshard",
    "shard_intervals",
]
