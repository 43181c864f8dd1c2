"""Controller side: start a group of MegatronWorkers and prove its process groups match the mesh.

Nothing here imports megatron-core: the controller only needs the workers' reports and the
pure comparison of :mod:`rankmesh.megatron.check`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from rankmesh.backends import ray as ray_backend  # names load on first use: no Ray at import
from rankmesh.megatron.check import RankReport, check_reports, compare_reports, Mismatch
from rankmesh.mesh import RankMesh

logger = logging.getLogger(__name__)


def collect_reports(group: Any, allreduce: bool = False, mesh: RankMesh | None = None) -> list[RankReport]:
    """Every rank's :class:`RankReport` (``megatron_report`` is ONE_TO_ALL: one per rank, rank order).

    With ``mesh`` (another mesh over the group's ranks) the ranks report on parallel_state rebuilt
    for ``mesh``, then return to their own (``MegatronWorker.megatron_report``).
    """
    raw = group.megatron_report(allreduce=allreduce) if mesh is None else group.megatron_report(allreduce=allreduce, mesh=mesh)
    return [r if isinstance(r, RankReport) else RankReport.from_dict(r) for r in raw]


def verify_group(group: Any, mesh: RankMesh | None = None, allreduce: bool = False) -> list[RankReport]:
    """Check every rank of ``group`` against ``mesh`` (default: the group's own mesh).

    Raises :class:`~rankmesh.errors.MeshMismatchError` listing the ranks that differ; returns the
    reports when all agree.
    """
    mesh = mesh if mesh is not None else group.mesh
    reports = collect_reports(group, allreduce=allreduce)
    check_reports(mesh, reports)
    logger.info("worker group agrees with %r on all %d ranks", mesh, len(reports))
    return reports


def find_mismatches(group: Any, mesh: RankMesh | None = None, allreduce: bool = False) -> tuple[list[RankReport], list[Mismatch]]:
    """Like :func:`verify_group`, but return the mismatches instead of raising."""
    mesh = mesh if mesh is not None else group.mesh
    reports = collect_reports(group, allreduce=allreduce)
    return reports, compare_reports(mesh, reports)


def start_megatron_group(
    resource_pool: Any,
    cls_with_init: Any,
    mesh: RankMesh,
    *,
    verify: bool = True,
    allreduce: bool = False,
    roles: list[str] | None = None,
    **group_kwargs: Any,
) -> Any:
    """Start a RayWorkerGroup of MegatronWorkers over ``mesh`` and cross-check it before returning.

    ``cls_with_init`` is a ``RayClassWithInitArgs`` (or a colocated class; then ``roles`` names the
    roles to spawn and a dict role -> group is returned).  With ``verify``, the same check runs
    again (with all-reduces) after every replacement of dead ranks.  On a mismatch the group is shut down
    and :class:`~rankmesh.errors.MeshMismatchError` raised, so no caller ever trains on groups
    that differ from what the controller dispatches by.
    """
    start = time.perf_counter()
    group = ray_backend.RayWorkerGroup(resource_pool, cls_with_init, mesh=mesh, **group_kwargs)
    checked = check_megatron_group(group, mesh, verify=verify, allreduce=allreduce, roles=roles)
    logger.info("started %r in %.1fs", mesh, time.perf_counter() - start)
    return checked


def check_megatron_group(
    group: Any, mesh: RankMesh, *, verify: bool = True, allreduce: bool = False, roles: list[str] | None = None
) -> Any:
    """The second half of :func:`start_megatron_group`, for a group started by other means.

    Spawns ``roles`` (a colocated class), cross-checks the group against ``mesh`` and registers the
    same check to run after every recovery; on a mismatch the group is shut down and
    :class:`~rankmesh.errors.MeshMismatchError` raised.  Returns the group, or role -> group.
    """
    spawned: Mapping[str, Any] | None = group.spawn(roles) if roles else None
    # Colocated roles share one parallel_state per process: checking one role checks all.
    checked = next(iter(spawned.values())) if spawned else group
    try:
        if verify:
            verify_group(checked, mesh, allreduce=allreduce)
            group.record_startup("cross-checked")
            # After dead ranks are replaced (or the group shrank or grew), parallel_state is rebuilt
            # everywhere: prove it again, against the group's mesh as it is then.
            group.add_recovery_check(lambda: verify_group(checked, allreduce=True))
    except BaseException:
        group.shutdown()
        raise
    return dict(spawned) if spawned else group


def shutdown_megatron_group(group: Any, stop: Callable[[Any], None] | None = None) -> None:
    """Tear parallel_state down on every rank (best effort), then stop the processes.

    ``stop``: how the processes stop (default ``group.shutdown``; e.g. ``PoolPerGroup.stop``).
    """
    try:
        group.destroy_megatron()
    except Exception as exc:  # noqa: BLE001 - the processes are stopped next anyway
        logger.warning("destroy_megatron failed: %s", exc)
    if stop is None:
        group.shutdown()
    else:
        stop(group)
