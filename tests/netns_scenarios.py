"""Drivers of tests/test_netns_cluster.py that run inside a namespaced cluster: Ray's view of its nodes, and of one node's loss.

Run as ``python -m tests.netns_scenarios NAME ARGS`` inside the head's namespace
(:meth:`rankmesh.testing.cluster.NetnsCluster.run`); ``ray.init()`` joins through ``RAY_ADDRESS``.
Each prints ``REPORT {json}`` lines (tests.drivers.print_report); ``watch`` also reads cue lines
from stdin, so the test can cut a node off at a known moment.

* ``nodes``: every node Ray lists (address, alive, raylet port), and for each alive node the
  address a task pinned to it (``NodeAffinitySchedulingStrategy``, hard) reports.
* ``group [slow]``: a rankmesh group of one rank per node (``RayResourcePool([1, 1, 1])``): each
  rank's node address, rank 0's rendezvous address, and a gloo all-reduce across the namespaces;
  with ``slow``, then ``READY``, and on the cue ``capped`` what a trace of three data calls and a
  call past its timeout say of the capped node.
* ``partition BEAT_DIR``: a group of two ranks with one warm spare
  (``on_rank_death="replace_or_shrink"``, one process per node, torch.distributed on gloo); reports
  where each runs, prints ``CALLING`` and makes a call in which every rank computes for
  :data:`WORK_S` (heartbeats in BEAT_DIR) and then all-reduces, which the test cuts rank 1's node
  off during (the survivor then waits in the all-reduce on the cut-off rank); reports the call's answer and the
  replacement; on the cue ``healed``, reports a call and an all-reduce of the group after the
  heal.  On the cue ``again`` it prints ``CALLING`` and makes the same call, during which the test
  cuts the other worker node off: with no spare and no room left, the group shrinks; it reports
  the answer, the shrink and a data call's rows, and on the cue ``healed`` a call after the heal.
* ``cut_head BEAT_DIR``: a group of one rank per node (``on_rank_death="replace"``); reports
  where each runs, prints ``CALLING`` and makes a :data:`WORK_S` call, during which the test cuts
  the head (the controller's own node) off; reports the error and what a later call says.
* ``watch ADDRESS OBSERVE_S``: prints ``READY``; on the cue line ``go`` waits until the node at
  ADDRESS is not alive and reports the seconds it took; with OBSERVE_S > 0 it then waits for the
  cue ``healed`` and reports every change of Ray's entries for ADDRESS during OBSERVE_S seconds.
"""

from __future__ import annotations

import os
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rankmesh.testing.cluster import ADDRESS_ENV
from tests.drivers import print_report

#: How often the watcher asks the GCS (well under the health-check period).
POLL_S = 0.1
#: The longest a watcher waits for a death before reporting that none came.
DEATH_TIMEOUT_S = 60.0


@ray.remote(num_cpus=1)
def my_address() -> str:
    return ray.util.get_node_ip_address()


def entries(address: str) -> list[dict]:
    """Ray's node entries at ``address`` (a node that re-registers would add one)."""
    return [{"id": n["NodeID"][:8], "alive": n["Alive"]} for n in ray.nodes() if n["NodeManagerAddress"] == address]


def nodes() -> dict:
    listed = [{"address": n["NodeManagerAddress"], "alive": n["Alive"], "port": n["NodeManagerPort"], "id": n["NodeID"]}
              for n in ray.nodes()]
    pinned = {
        n["address"]: my_address.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["id"], soft=False)).remote()
        for n in listed if n["alive"]
    }
    return {"nodes": listed, "pinned": {address: ray.get(ref, timeout=60) for address, ref in pinned.items()}}


def group(slow: bool) -> None:
    """A rankmesh group of one rank per node: where each rank landed, and a gloo all-reduce over
    the links (the first report).  With ``slow``, then the same group over a capped link: it
    prints ``READY``, waits for the cue ``capped`` (the test caps the last node), and reports what
    a trace and a timed-out call say of it (:func:`slow_link`)."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.multinode_worker import NodeWorker

    # NodeWorker.where asks Ray's runtime context for its node: Ray actors (a forked rank has no Ray worker).
    wg = RayWorkerGroup(RayResourcePool([1, 1, 1], use_gpu=False), RayClassWithInitArgs(NodeWorker), process_model="ray")
    try:
        where = wg.where()
        print_report({"node_ips": [info["node_ip"] for info in wg.node_info], "master": where[0]["MASTER_ADDR"],
                      "ranks": [w["rank"] for w in where], "sums": wg.all_reduce()})
        if slow:
            print_report(slow_link(wg))
    finally:
        wg.shutdown()


#: Each rank's piece of the traced data calls, and of the call that times out: over the test's
#: 8 Mbit/s cap (1 MB/s) the first takes ~0.26 s to reach the capped node, the second ~2.1 s,
#: against milliseconds on the other links.
TRACED_PIECE_BYTES = 256 << 10
HANG_PIECE_BYTES = 2 << 20
#: The timed-out call's timeout: past the uncapped ranks' time, well short of the capped one's.
HANG_TIMEOUT_S = 1.0


def slow_link(wg) -> dict:
    """Three traced data calls and one past its timeout, over a link the test capped (after ``READY``)."""
    import tempfile

    import torch

    import rankmesh
    from rankmesh.data import DataProto
    from rankmesh.errors import HangError
    from rankmesh.tracing.summary import summarize

    def batch(piece_bytes: int) -> DataProto:  # 3 pieces of 4 rows, one per rank
        return DataProto.from_dict({"x": torch.zeros(12, piece_bytes // 4 // 4)})

    traced = batch(TRACED_PIECE_BYTES)
    wg.rows(traced)  # the method's first call (imports, slots) before the link is capped
    print("READY", flush=True)
    wait_cue("capped")
    path = os.path.join(tempfile.mkdtemp(), "slow.json")
    with rankmesh.trace(path):
        for _ in range(3):
            wg.rows(traced)
    summary = summarize(path)
    rows = next(m for m in summary.methods if m.method == "rows")
    out: dict = {"straggler": rows.straggler, "slowest": rows.slowest, "summary": summary.format()}
    try:
        wg.with_timeout(HANG_TIMEOUT_S).rows(batch(HANG_PIECE_BYTES))
        out["hang"] = None
    except HangError as exc:
        out["hang"] = {"ranks": exc.ranks, "nodes": [h.node for h in exc.hangs], "text": str(exc)}
    return out


#: How long the partition call's ranks compute (seconds from its start): past the time the test
#: needs to cut the node off, the GCS to declare it dead (TEST_HEALTH_CHECKS: ~6 s) and a spare to
#: take its rank's place, so the cut-off rank is still at work through all of it.
WORK_S = 15.0


def partition(beat_dir: str) -> None:
    """See the module docstring (``partition``)."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.multinode_worker import NodeWorker

    import torch

    from rankmesh.data import DataProto

    wg = RayWorkerGroup(RayResourcePool([1, 1], use_gpu=False, spares=1), RayClassWithInitArgs(NodeWorker, distributed=True),
                        on_rank_death="replace_or_shrink", call_timeout_s=120)
    try:
        first = wg.work(0.0, beat_dir, True)  # answers at once: the undisturbed answer, and each rank's pid
        spares = wg.spares
        print_report({"node_ips": [info["node_ip"] for info in wg.node_info], "pids": [w["pid"] for w in first],
                      "undisturbed": [w["value"] for w in first], "sums": [w["sum"] for w in first], "spares": len(spares),
                      "control": wg.executor.control_paths()})
        until = time.time() + WORK_S
        print("CALLING", flush=True)
        start = time.monotonic()
        got = wg.work(until, beat_dir, True)
        seconds = time.monotonic() - start
        rep = wg.replacements[-1] if wg.replacements else None
        print_report({"values": [w["value"] for w in got], "sums": [w["sum"] for w in got], "pids": [w["pid"] for w in got],
                      "seconds": seconds, "drain_s": rep.drain_s if rep else None,
                      "replaced": rep.ranks if rep else [], "from_spares": rep.from_spares if rep else [],
                      "old_nodes": rep.old_nodes if rep else {}, "new_nodes": rep.new_nodes if rep else {},
                      "detected_s": rep.detected_s if rep else None, "format": rep.format() if rep else ""})
        wait_cue("healed")
        after = wg.work(0.0, beat_dir)
        print_report({"values": [w["value"] for w in after], "pids": [w["pid"] for w in after], "sums": wg.all_reduce(),
                      "node_ips": [info["node_ip"] for info in wg.node_info]})
        wait_cue("again")  # no spare left now, and no node with room: the policy shrinks
        print("CALLING", flush=True)
        start = time.monotonic()
        got = wg.work(time.time() + WORK_S, beat_dir, True)
        seconds = time.monotonic() - start
        shrunk = wg.remeshes[-1] if wg.remeshes else None
        rows = wg.rows(DataProto.from_dict({"x": torch.arange(4)}))
        print_report({"values": [w["value"] for w in got], "sums": [w["sum"] for w in got], "pids": [w["pid"] for w in got],
                      "seconds": seconds,
                      "replacements": len(wg.replacements), "world": wg.world_size, "rows": rows.batch["rank"].tolist(),
                      "shrink": None if shrunk is None else {"kind": shrunk.kind, "lost_replicas": shrunk.lost_replicas,
                                                             "dead": shrunk.dead, "detected_s": shrunk.detected_s,
                                                             "format": shrunk.format()}})
        wait_cue("healed")
        last = wg.work(0.0, beat_dir)
        print_report({"values": [w["value"] for w in last], "pids": [w["pid"] for w in last]})
    finally:
        wg.shutdown()


def cut_head(beat_dir: str) -> None:
    """See the module docstring (``cut_head``)."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.multinode_worker import NodeWorker

    wg = RayWorkerGroup(RayResourcePool([1, 1, 1], use_gpu=False), RayClassWithInitArgs(NodeWorker),
                        on_rank_death="replace", call_timeout_s=120)
    try:
        wg.work(0.0, beat_dir)
        print_report({"node_ips": [info["node_ip"] for info in wg.node_info]})
        until = time.time() + WORK_S
        print("CALLING", flush=True)
        start = time.monotonic()
        out: dict = {}
        try:
            wg.work(until, beat_dir)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported whatever it is
            out["error"] = {"type": type(exc).__name__, "text": str(exc), "ranks": getattr(exc, "ranks", None),
                            "node": getattr(exc, "node", None), "lost_nodes": getattr(exc, "lost_nodes", None)}
        out["seconds"] = time.monotonic() - start
        out["replacements"] = len(wg.replacements)
        try:
            wg.where()
            out["later"] = None
        except Exception as exc:  # noqa: BLE001 - reported whatever it is
            out["later"] = f"{type(exc).__name__}: {exc}"
        print_report(out)
    finally:
        wg.shutdown()


def wait_cue(cue: str) -> None:
    line = sys.stdin.readline().strip()
    if line != cue:
        raise SystemExit(f"expected the cue {cue!r} on stdin, got {line!r}")


def watch(address: str, observe_s: float) -> None:
    entries(address)  # the first GCS query is slower: pay it before the cue
    print("READY", flush=True)
    wait_cue("go")
    t0 = time.monotonic()
    while any(e["alive"] for e in entries(address)):
        if time.monotonic() - t0 > DEATH_TIMEOUT_S:
            print_report({"dead_after_s": None})
            return
        time.sleep(POLL_S)
    print_report({"dead_after_s": time.monotonic() - t0})
    if observe_s <= 0:
        return
    wait_cue("healed")
    t0 = time.monotonic()
    seen = [{"t": 0.0, "entries": entries(address)}]
    while time.monotonic() - t0 < observe_s:
        now = entries(address)
        if now != seen[-1]["entries"]:
            seen.append({"t": round(time.monotonic() - t0, 2), "entries": now})
        time.sleep(POLL_S)
    print_report({"after_heal": seen})


if __name__ == "__main__":
    # Bound to the head's address inside the cluster (tests.test_netns_cluster runs drivers there).
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[ADDRESS_ENV], logging_level="ERROR")
    name, args = sys.argv[1], sys.argv[2:]
    if name == "nodes":
        print_report(nodes())
    elif name == "group":
        group(slow=args[:1] == ["slow"])
    elif name == "partition":
        partition(args[0])
    elif name == "cut_head":
        cut_head(args[0])
    elif name == "watch":
        watch(args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown scenario {name!r}; use nodes, group or watch")
