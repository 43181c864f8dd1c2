"""Node loss, then replacement: the lost node's ranks are re-placed on a spare node.

Runs as a subprocess driver (``python -m tests.recovery_node_loss``; one cluster connection per
process): a CPU-less head plus three 2-CPU nodes (raylets on 127.0.0.1 it starts, or a namespaced
cluster its test made: ``tests/node_faults.py``), a 4-rank group (dp 4) on the first two, the
second killed (on loopback, ``remove_node`` and the wait for its processes to exit, as a real
node's go with it: a call on the ring would otherwise still reach them), then a call with
``on_rank_death="replace"``: the dead
ranks are replaced, Ray having re-placed their bundles on the spare third node, and the call
returns the undisturbed result.  Prints one ``REPORT {json}`` line.  Used by
``tests/test_recovery_multinode.py`` and ``scripts/fault_drill.py``.
"""

from __future__ import annotations

import os
import signal
import time

from tests.drivers import print_report
from tests.reliability_node_loss import FAST_HEALTH_CHECKS


#: The three 2-CPU nodes of the scenario (a CPU-less head besides).
NODES = [{"num_cpus": 2, "object_store_memory": 80 << 20} for _ in range(3)]


def run() -> dict:
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.mesh import RankMesh
    from tests.node_faults import nodes_for
    from tests.recovery_workers import StateWorker

    report: dict = {}
    nodes = nodes_for(NODES, FAST_HEALTH_CHECKS)
    try:
        wg = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(StateWorker, scale=1),
                            mesh=RankMesh(dp=4), on_rank_death="replace", call_timeout_s=120)
        by_node = {node: i for i, node in enumerate(nodes.ids)}
        before = wg.whoami()
        placed = [by_node[wg.node_of(r)] for r in range(4)]
        victim_index = placed[2]
        report["ranks_on_victim"] = [r for r in range(4) if placed[r] == victim_index]
        nodes.kill(nodes.ids[victim_index])
        removed = time.monotonic()
        report["victims_killed"] = gone_or_killed([before[r]["pid"] for r in report["ranks_on_victim"]], 10.0)
        report["result"] = wg.world_sum([1.0, 2.0, 3.0, 4.0])  # undisturbed: 10.0 on every rank
        report["seconds"] = time.monotonic() - removed
        rep = wg.replacements[-1] if wg.replacements else None
        report["replaced"] = rep.ranks if rep else []
        report["format"] = rep.format() if rep else ""
        report["timings"] = {k: getattr(rep, k) for k in ("detected_s", "drain_s", "start_s", "import_s", "init_s",
                                                            "restore_s", "total_s")} if rep else {}
        # The new processes' node had no agent of the group: one started while they started and
        # restored, and the retried call's session took it rather than starting its own.
        report["agents_started"] = [by_node.get(n) for n in getattr(rep, "agents_started", [None])]
        report["agents_the_call_started"] = [by_node.get(n) for n in getattr(wg.executor.session, "started", [None])]
        after = wg.whoami()
        report["nodes_after"] = [by_node.get(wg.node_of(r)) for r in range(4)]
        report["nodes_before"] = placed
        report["victim"] = victim_index
        report["survivor_pids_kept"] = all(after[r]["pid"] == before[r]["pid"] for r in range(4)
                                           if r not in report["replaced"])
        wg.shutdown()
        report["shrink"] = shrink_then_grow(nodes, [n for i, n in enumerate(nodes.ids) if i != victim_index])
    finally:
        nodes.close()
    return report


def gone_or_killed(pids: list[int], wait_s: float) -> list[int]:
    """Wait up to ``wait_s`` for ``pids`` to exit; SIGKILL those that have not. Returns the killed ones."""
    end = time.monotonic() + wait_s
    left = list(pids)
    while left and time.monotonic() < end:
        left = [p for p in left if _alive(p)]
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def shrink_then_grow(nodes, ids: list[str]) -> dict:
    """Spare, spares exhausted, shrink, grow, on the two 2-CPU nodes left plus a 1-CPU node for a spare.

    A tp2·dp2 group, one replica per 2-CPU node, ``spares=1`` (the spare can only go to the 1-CPU
    node), ``on_rank_death="replace_or_shrink"``: (1) rank 3 dies and the spare takes its place;
    (2) once the refilled spare is warm (in rank 3's old bundle), its node is removed with rank 2
    on it: no spare is left and no node has room, so the group drops replica 1 (tp2·dp1); (3) a
    node joins and ``grow(1)`` brings tp2·dp2 back.
    """
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.recovery import exit_on_next_call
    from rankmesh.backends.ray.spares import SpareStatus
    from rankmesh.mesh import RankMesh
    from tests.recovery_workers import StateWorker

    def wait_warm_spare(exclude: set) -> SpareStatus:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            spares = wg.spares
            if spares and spares[0].warm and spares[0].pid not in exclude:
                return spares[0]
            time.sleep(0.1)
        raise TimeoutError(f"no warm spare: {wg.spares}")

    out: dict = {}
    ids = [*ids, nodes.add({"num_cpus": 1, "object_store_memory": 80 << 20})]
    wg = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False, spares=1), RayClassWithInitArgs(StateWorker, scale=1),
                        mesh=RankMesh(tp=2, dp=2), on_rank_death="replace_or_shrink", call_timeout_s=120)
    try:
        by_node = {node: i for i, node in enumerate(ids)}
        wg.set_state([[10.0 * (r % 2) + k for k in (1, 2, 3)] for r in range(4)])  # tp rank r % 2
        before = wg.whoami()
        spare = wait_warm_spare(set())
        out["spare_on_small_node"] = by_node[spare.node_id] == len(ids) - 1
        # The spare's node has no rank: its node agent stands by (started with the session).
        standby = {node: agent._actor_id.hex() for node, agent in getattr(wg.executor.session, "standby", {}).items()}
        # (1) A warm spare takes rank 3's place.
        exit_on_next_call(wg, 3, "world_sum")
        out["result_spare"] = wg.world_sum([1.0, 2.0, 3.0, 4.0])
        serving = wg.executor.session.agents.get(spare.node_id)
        out["spare_node_agent"] = [standby.get(spare.node_id), serving and serving._actor_id.hex()]
        rep = wg.replacements[-1]
        out["spare_taken"] = {"ranks": rep.ranks, "from_spares": rep.from_spares, "format": rep.format(),
                              "seconds": (rep.detected_s or 0.0) + rep.total_s}
        # (2) The refilled spare sits in rank 3's old bundle, on rank 2's node: remove that node.
        refill = wait_warm_spare({spare.pid})
        victim = by_node[wg.node_of(2)]
        out["refill_on_victim"] = by_node[refill.node_id] == victim
        out["ranks_on_victim"] = [r for r in range(4) if by_node[wg.node_of(r)] == victim]
        pids = [a["pid"] for r, a in enumerate(wg.whoami()) if r in out["ranks_on_victim"]] + [refill.pid]
        nodes.kill(ids[victim])
        removed = time.monotonic()
        # A node that is gone takes its processes with it; a simulated node's workers notice their
        # raylet's death on their own, so wait for that (and kill what lingers), or the next call
        # may still reach them through the ring (a namespaced node's were SIGKILLed with it).
        out["victims_killed"] = gone_or_killed(pids, 10.0)
        out["result"] = wg.world_sum([1.0, 2.0, 3.0, 4.0])  # on tp2·dp1: ranks 0, 1 sum 1 + 2
        out["seconds"] = time.monotonic() - removed
        shrunk = wg.remeshes[-1] if wg.remeshes else None
        out["shrink"] = {"lost_replicas": shrunk.lost_replicas, "dead": shrunk.dead, "format": shrunk.format(),
                         "detected_s": shrunk.detected_s, "total_s": shrunk.total_s} if shrunk else None
        out["mesh_after_shrink"] = repr(wg.mesh)
        out["data_after_shrink"] = data_calls(wg)
        out["survivor_pids_kept"] = [a["pid"] for a in wg.whoami()] == [before[0]["pid"], before[1]["pid"]]
        # (3) Capacity comes back: grow to tp2·dp2 again.
        nodes.add({"num_cpus": 2, "object_store_memory": 80 << 20})
        start = time.monotonic()
        grown = wg.grow(1)
        out["grow_seconds"] = time.monotonic() - start
        out["grow"] = {"added": grown.added, "peers": {str(k): v for k, v in grown.peers.items()}, "format": grown.format(),
                       "total_s": grown.total_s}
        out["mesh_after_grow"] = repr(wg.mesh)
        out["state_after_grow"] = wg.get_state()
        out["result_after_grow"] = wg.world_sum([1.0, 2.0, 3.0, 4.0])
        out["grow_and_call_seconds"] = time.monotonic() - start  # the first call opens the grown group's session
        # The old nodes' agents served on; the new node's was started during the grow.
        out["grow_agents"] = {"started": [by_node.get(n, "new") for n in getattr(grown, "agents_started", [None])],
                              "new_node": by_node.get(wg.node_of(2), "new"),
                              "the_call_started": [by_node.get(n, "new")
                                                   for n in getattr(wg.executor.session, "started", [None])]}
        out["data_after_grow"] = data_calls(wg)
    finally:
        wg.shutdown()
    return out


def data_calls(wg) -> dict:
    """A small batch (inside the call) and a large one (pieces over 100 KiB, in the store), each
    through ``tag_rows`` (DP_COMPUTE_PROTO: every rank a piece, each row tagged with its rank):
    the tags, the rows back in order, and which carriers took the calls."""
    import torch

    from rankmesh.data import DataProto

    before = dict(wg.executor.stats.by_carrier)
    out: dict = {}
    for name, cols in (("small", 1), ("large", 40_000)):  # 8 rows of 160 KB: a piece of 2 rows is 320 KB
        x = torch.arange(8.0).unsqueeze(1).repeat(1, cols)
        got = wg.tag_rows(DataProto.from_dict({"x": x}))
        out[name] = {"rank": got.batch["rank"].tolist(), "rows_back": bool(torch.equal(got.batch["x"], x))}
    out["carriers"] = {k: v - before.get(k, 0) for k, v in wg.executor.stats.by_carrier.items() if v != before.get(k, 0)}
    return out


def main() -> None:
    print_report(run())


if __name__ == "__main__":
    main()
