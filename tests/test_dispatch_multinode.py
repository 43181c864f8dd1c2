"""Every dispatch mode on groups across nodes: the backend-neutral matrix's cases on the shared simulated cluster.

tests/dispatch_matrix.py's routing tables are derived by hand for a mesh, whatever carries the
calls.  Here its cases run on groups whose ranks sit on two nodes, so every mode's pieces reach
the ranks through the node agents (one Ray task per top agent: shares, a selection's key, data
pieces by reference, the collect ranks answering) and every collect set spans both nodes.  Two
groups, one after the other, each kept for all of its mesh's cases (a group per case would cost
minutes here):

* tp2·dp2·pp2, 8 ranks in two pools of four (two nodes): the routing of every proto and list
  mode (``MEGATRON_COMPUTE(_PROTO)``, ``MEGATRON_PP_AS_DP(_PROTO)``, ``DP_COMPUTE(_PROTO)``),
  ``ONE_TO_ALL``, ``MEGATRON_PP_ONLY``, ``RANK_ZERO``, execute-rank-zero, a spec over the pp
  axis, the round trips (blocking and not, padded: a non-blocking data call's future gets the
  collect ranks' references alone), the padding error, isolation;
* dp4, 4 ranks in two pools of two: ``ALL_TO_ALL``, ``DP_COMPUTE_METRIC``,
  ``DP_COMPUTE_PROTO_WITH_FUNC``, user modes, non-blocking list outputs, a future's private
  copies, async methods, ``execute_all``.

The cases run in the cluster's driver process (:func:`run_cases`), which returns one report.
"""

from __future__ import annotations

from typing import Any

import pytest

#: The pools of each mesh's group: one node each (a pool entry is one node's bundles).
POOLS = {"tp2dp2pp2": [4, 4], "dp4": [2, 2]}
#: Each pool's ``max_colocate_count``, which is its bundles' CPUs: an entry must need more CPUs
#: than half of a 4-CPU node (tests/drivers.py SHARED_NODES), or Ray may pack both entries onto
#: one node (STRICT_PACK holds within an entry, not between entries).  dp4's 2 x 2 CPUs fill
#: node_a and node_b; tp2dp2pp2's 4 x 1 does already.
COLOCATE = {"tp2dp2pp2": 1, "dp4": 2}


def _cases() -> list[tuple[str, str, dict]]:
    """(mesh, the matrix's function, its parameters), each mesh's cases together."""
    from tests.dispatch_matrix import LIST_METHODS, PROTO_METHODS, ROUND_TRIP

    mesh = "tp2dp2pp2"
    cases = [(mesh, "test_proto_mode_routing", {"mesh_name": mesh, "method": m}) for m in PROTO_METHODS]
    cases += [(mesh, "test_list_mode_routing", {"mesh_name": mesh, "method": m}) for m in LIST_METHODS]
    cases += [(mesh, "test_replicated_modes", {"mesh_name": mesh})]
    cases += [(mesh, name, {}) for name in ("test_execute_rank_zero_mode", "test_spec_over_pp_axis",
                                            "test_padding_error_names_size_and_divisor",
                                            "test_isolation_between_ranks_and_caller")]
    cases += [(mesh, "test_round_trip", {"method": m, "blocking": b, "rows": r, "meta": meta})
              for m, b, r, meta in ROUND_TRIP]
    cases += [("dp4", name, {}) for name in ("test_all_to_all", "test_dp_compute_metric_is_never_trimmed",
                                             "test_dp_compute_proto_with_func", "test_user_modes",
                                             "test_nonblocking_list_outputs", "test_future_results_are_private_copies",
                                             "test_async_methods", "test_execute_all_and_rank_zero")]
    return cases


def case_id(name: str, params: dict) -> str:
    shown = {k: v for k, v in params.items() if k != "meta"}
    if params.get("meta"):
        shown["meta"] = "padded"
    return name + "".join(f"[{v}]" for v in shown.values())


class OneGroupAtATime:
    """The cases' ``group_factory``: one group per mesh of :data:`POOLS`, of the matrix's
    RecordingWorker, kept while its mesh's cases run; the previous one is shut down first."""

    def __init__(self) -> None:
        self.key: Any = None
        self.group: Any = None
        self.nodes: dict[str, int] = {}  # mesh -> how many nodes its group's ranks are on

    def __call__(self, worker_cls, mesh=None, *, meshes=None, init_args=(), init_kwargs=None):
        from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from tests.dispatch_matrix import MESHES
        from tests.dispatch_workers import RecordingWorker

        name = next((n for n, m in MESHES.items() if m == mesh), None)
        if worker_cls is not RecordingWorker or name not in POOLS or meshes or init_args or init_kwargs:
            raise LookupError(f"no group here for {worker_cls.__name__} on {mesh}")
        if self.key != name:
            self.close()
            pool = RayResourcePool(POOLS[name], use_gpu=False, max_colocate_count=COLOCATE[name])
            self.group = RayWorkerGroup(pool, RayClassWithInitArgs(worker_cls), mesh=mesh)
            self.key = name
            self.nodes[name] = len({info["node_id"] for info in self.group._hosts.info})
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group = self.key = None


def run_cases(cluster) -> dict:
    """Runs inside the driver process: every case, in order; its outcome (``"passed"`` or the error)."""
    import traceback

    from tests import dispatch_matrix

    groups = OneGroupAtATime()
    outcomes: dict[str, str] = {}
    paths: dict[str, list[str]] = {}
    try:
        for mesh, name, params in _cases():
            try:
                getattr(dispatch_matrix, name)(groups, **params)
                outcomes[case_id(name, params)] = "passed"
            except Exception as exc:  # noqa: BLE001 - each case's error, for its own assertion
                outcomes[case_id(name, params)] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if mesh not in paths and groups.group is not None:
                paths[mesh] = groups.group.executor.control_paths()
    finally:
        groups.close()
    return {"outcomes": outcomes, "nodes": groups.nodes, "paths": paths}


@pytest.fixture(scope="module")
def report(simulated_cluster) -> dict:
    return simulated_cluster.run("tests.test_dispatch_multinode:run_cases", timeout=900)


def test_each_group_spans_two_nodes_through_the_node_agents(report):
    assert report["nodes"] == {"tp2dp2pp2": 2, "dp4": 2}
    assert report["paths"] == {"tp2dp2pp2": ["agent"] * 8, "dp4": ["agent"] * 4}


@pytest.mark.parametrize("case", [case_id(name, params) for _, name, params in _cases()])
def test_a_dispatch_case_of_the_matrix_holds_across_nodes(report, case):
    assert report["outcomes"][case] == "passed"
