"""Replica selections: which ranks of a group make up some of its dp replicas, and a backend over them.

Why a group needs them: in an asynchronous RL pipeline the rollout's dp replicas generate at
their own pace, and a refit or a generation call should reach one replica while the others keep
working.  A replica (megatron's dense data-parallel index) is a whole model copy: every tp, cp and
pp rank with that dp coordinate.  :func:`select_replicas` finds those ranks and the mesh they form
on their own (the group's mesh with ``dp`` = the number of replicas), so that every dispatch mode
plans over the selection exactly as it plans over a whole group; :class:`RankSubset` is the
group's backend seen through the selection (view rank ``i`` is group rank ``ranks[i]``), so a
call on a view takes the group's own path: the same processes, queues, timeouts, hang reports
and failure handling.  A view is valid for the generation of its group it was taken in: once
the group's ranks are renumbered (a shrink, a grow) it refuses every call with
:class:`~rankmesh.errors.StaleViewError`, saying what changed (a replaced rank keeps its number:
views stay valid across a replacement).

Expected ranks come from the mesh's own coordinate tables: view rank ``s`` with coordinates
(tp, cp, dp=j, pp) in the view's mesh is the group rank with (tp, cp, dp=replicas[j], pp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from rankmesh.backend import Backend, Change, GroupCall, RankCall, Selection
from rankmesh.deadline import Deadline
from rankmesh.dispatch.spec import DispatchPlan
from rankmesh.dispatch.split import CallSite
from rankmesh.errors import DispatchError, StaleViewError
from rankmesh.mesh import RankMesh
from rankmesh.validate import is_int


@dataclass(frozen=True)
class ReplicaSelection:
    """Some dp replicas of a mesh: their ids (in the order given), their group ranks, their own mesh.

    ``ranks[s]`` is the group rank of view rank ``s``; ``mesh`` is the view's mesh (the group's
    with ``dp=len(replicas)``), whose dp coordinate ``j`` is the group's replica ``replicas[j]``.
    """

    replicas: tuple[int, ...]
    ranks: tuple[int, ...]
    mesh: RankMesh

    @property
    def label(self) -> str:
        """``replica 1`` / ``replicas 0,2``: how traces and messages name the selection."""
        ids = ",".join(map(str, self.replicas))
        return f"replica {ids}" if len(self.replicas) == 1 else f"replicas {ids}"

    def local_rank(self, group_rank: int) -> int:
        """The view rank of ``group_rank`` (it must be one of :attr:`ranks`)."""
        return self.ranks.index(group_rank)


def select_replicas(mesh: RankMesh, replicas: Sequence[int], what: str = "replicas") -> ReplicaSelection:
    """The ranks and mesh of dp replicas ``replicas`` of ``mesh`` (order kept: data piece ``j`` goes to ``replicas[j]``).

    Refused, naming the argument: an empty or repeated selection, an id outside ``0..dp-1``, and
    expert parallelism (``ep > 1``), whose expert groups span dense replicas, so that one replica
    cannot run a step without the others.
    """
    dp = mesh.size("dp")
    ids = tuple(replicas)
    bad = [r for r in ids if not is_int(r) or not 0 <= r < dp]
    if not ids or bad:
        raise DispatchError(f"{what} must name dp replicas of the group (0..{dp - 1} for {mesh}), got {list(ids)}")
    if len(set(ids)) != len(ids):
        raise DispatchError(f"{what} {list(ids)} names a replica twice; name each once")
    if mesh.size("ep") > 1:
        raise DispatchError(
            f"{what}: the group's mesh {mesh} has expert parallelism (ep={mesh.size('ep')}), whose groups span "
            f"dp replicas, so a replica cannot run alone; call the whole group"
        )
    sizes = mesh.sizes
    view = RankMesh(tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"], dp=len(ids), order=mesh.order)
    table = view.coord_table()
    ranks = tuple(
        mesh.rank_of(tp=int(table["tp"][s]), pp=int(table["pp"][s]), cp=int(table["cp"][s]), dp=ids[int(table["dp"][s])])
        for s in range(view.world_size)
    )
    return ReplicaSelection(tuple(int(r) for r in ids), ranks, view)


def restrict_plan(plan: DispatchPlan, selection: ReplicaSelection, site: CallSite) -> DispatchPlan:
    """A whole group's ``plan`` seen through ``selection``: its ranks that run, renumbered, and their pieces.

    For methods the view's own mesh does not plan (a named mesh, a mesh verl workers register).
    Pieces are numbered in the order the view's ranks first hold them; each needs a collect
    rank inside the view, else its output would be lost: that is refused, naming the method.
    """
    local = {g: s for s, g in enumerate(selection.ranks)}
    run = sorted(local[g] for g in plan.run_ranks if g in local)
    piece_of = [plan.piece_of_rank[g] for g in selection.ranks]  # by view rank
    number: dict[int, int] = {}
    for s in run:
        number.setdefault(piece_of[s], len(number))
    collect = sorted((local[g] for g in plan.collect_ranks if g in local and plan.piece_of_rank[g] in number),
                     key=lambda s: (number[piece_of[s]], s))
    if not run or {number[piece_of[s]] for s in collect} != set(range(len(number))):
        raise site.error(
            f"its plan collects from ranks {list(plan.collect_ranks)} of the group, which do not cover every data piece of "
            f"the {selection.label} view (ranks {list(selection.ranks)}); call it on the whole group"
        )
    return DispatchPlan(
        n_pieces=len(number),
        piece_of_rank=tuple(number.get(p, 0) for p in piece_of),
        collect_ranks=tuple(collect),
        run_ranks=tuple(run),
    )


class RankSubset:
    """:class:`~rankmesh.backend.Backend` over some ranks of another backend (view rank ``i`` = ``ranks[i]``).

    It owns nothing: shipping, fetching, timeouts, failure and closing are the group backend's,
    so a view never outlives its group and a dead rank fails (or is replaced in) the whole
    group as any call would.  Closing a view is refused: shut the group down.
    """

    def __init__(self, backend: Backend, selection: ReplicaSelection) -> None:
        self.backend = backend
        self.selection = selection
        self.world_size = len(selection.ranks)
        self.taken_at = backend.generation  # the group's generation this view was taken in
        self._mapped: dict[int, Selection] = {}  # a reusable selection's key -> the same one in group ranks

    def _in_group(self, chosen: Selection) -> Selection:
        """``chosen`` (view ranks) in group ranks; a reusable one is mapped once and kept, its key its own."""
        if chosen.key is None:
            return chosen.mapped(self.selection.ranks)
        mapped = self._mapped.get(chosen.key)
        if mapped is None:
            mapped = self._mapped[chosen.key] = chosen.mapped(self.selection.ranks)
        return mapped

    @property
    def generation(self) -> int:
        return self.backend.generation

    def changes_since(self, generation: int) -> list[Change]:
        return self.backend.changes_since(generation)

    def check_current(self, what: str) -> None:
        """Refuse ``what`` once the group's ranks were renumbered since this view was taken."""
        renumbered = [c.what for c in self.backend.changes_since(self.taken_at) if c.renumbered]
        if renumbered:
            raise StaleViewError(
                f"{what}: this {self.selection.label} view was taken before the group changed "
                f"({'; '.join(renumbered)}), so its ranks would be other replicas' now; take a new view "
                "(wg.replica(i) or wg.replicas([...])) and call it again")

    @property
    def call_timeout_s(self) -> float | None:
        return self.backend.call_timeout_s

    @property
    def closed(self) -> bool:
        return self.backend.closed

    @property
    def failed(self) -> BaseException | None:
        return self.backend.failed

    def share(self, obj: Any) -> Any:
        return self.backend.share(obj)

    def submit(
        self, role: str | None, method: str, calls: Sequence[RankCall] | GroupCall, deadline: Deadline | None = None
    ) -> Sequence[Any]:
        self.check_current(method)
        ranks = self.selection.ranks
        if isinstance(calls, GroupCall):
            chosen = calls.selection
            bad = [r for r in chosen.ranks if not 0 <= r < self.world_size]
            if bad:
                raise DispatchError(f"{method}: ranks {bad} are outside the {self.selection.label} view ({self.world_size} ranks)")
            return self.backend.submit(role, method, GroupCall(calls.shares, self._in_group(chosen), calls.outputs_only), deadline)
        for call in calls:
            if not 0 <= call.rank < self.world_size:
                raise DispatchError(f"{method}: rank {call.rank} is outside the {self.selection.label} view ({self.world_size} ranks)")
        return self.backend.submit(role, method, [dataclasses.replace(c, rank=ranks[c.rank]) for c in calls], deadline)

    def fetch(
        self, pending: Sequence[Any], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None,
        deadline: Deadline | None = None,
    ) -> list[Any]:
        return self.backend.fetch(pending, timeout=timeout, borrow=borrow, stall_warn_s=stall_warn_s, deadline=deadline)

    def fetcher(self, timeout: float | None = None, stall_warn_s: float | None = None) -> Any:
        return self.backend.fetcher(timeout, stall_warn_s)

    def drain_timings(self) -> list[tuple[int, list[Any], int, int, int]]:
        """The group backend's (traces of a view's calls are kept on the group's tracks, in group ranks)."""
        return self.backend.drain_timings()

    def control_paths(self) -> list[str]:
        self.check_current("control_paths")
        paths = self.backend.control_paths()
        return [paths[r] for r in self.selection.ranks]

    def close(self) -> None:
        raise DispatchError(f"a {self.selection.label} view cannot be shut down on its own; shut the group down")


__all__ = ["RankSubset", "ReplicaSelection", "restrict_plan", "select_replicas"]
