#!/usr/bin/env python
"""Group calls through a call session against the Ray task-per-rank path, side by side in one run.

One group of ``N`` ranks on this node switches between its call session
(``rankmesh.backends.ray.session``: one message per call through a shared-memory ring) and the
Ray path (one Ray task per rank) with ``wg.set_control``, in blocks of ``--block`` calls within
one run (the machine is shared and noisy).  For each N this prints:

* p50 and p99 of a no-op round trip (``wg.noop()``, a real ``@register`` method);
* the controller's CPU per call (``time.process_time`` of the controller process over the blocks), and
  the ranks' CPU per call, all ranks together (their processes' CPU times over the blocks);
* start skew: the spread of the ranks' entry times into ``stamp()``;
* the first call after ``--idle-s`` of idleness, and the ranks' CPU over ``--idle-cpu-s``
  after their last call (largest N only).

``--cluster`` does the same on a simulated cluster (``ray.cluster_utils.Cluster`` on loopback)
for groups of NODES x RANKS, through node agents, and fits ``a + b·nodes + c·ranks`` to the
controller's CPU and to the p50 round trip, extrapolated to 1,024 nodes x 8 ranks.  With
``--fanout F`` the agents are also measured in a tree ``F`` wide (``agent_fanout``), and a tree
model (the controller's CPU per send and per rank, the tree's depth) is extrapolated to 1,024 nodes.
With ``--data`` the call timed is a ``MEGATRON_COMPUTE_PROTO`` call instead of a no-op (mesh
``tp`` = ranks per node, ``dp`` = nodes, 4 rows per piece): on the agent path the pieces travel by
reference through the agents, so the controller's CPU should not move with the ranks per node.

``--scale NODESxRANKS,...`` measures the controller alone at shapes no machine here could start
(1,024 x 8, 4,096 x 8): the real group, executor, agent session and wait loop, against in-process
stand-ins for the node agents whose ranks answer at once (:class:`InstantAgents`).  It prints the
controller's CPU per no-op call to every rank, a fit ``a + b·nodes + c·ranks``, and what doubling
the ranks per node does.  Left out: the network, the agents' and ranks' own CPU, and Ray's
background threads in the controller; each send to a top agent is timed against a live agent
in the same run and added.

``--threads N`` runs N callers on one group at once (the last one's calls non-blocking) and
prints each caller's round trips against one kind of caller alone.

With ``--later`` it is a non-blocking no-op call to every rank instead, its future (every rank's
output: a ``GroupFuture``) read at once: through the agents each top agent answers its subtree
joined, so the controller's CPU should not move with the ranks per node either.

``--kill`` adds the failure drill: a rank SIGKILLed mid-call (time to the group's error), and
the controller SIGKILLed (time until its ranks' processes are gone), with ``/dev/shm`` listed
before and after.

    python scripts/bench_control_plane.py                      # N = 1, 2, 4, 8, 16; 1000 calls each
    python scripts/bench_control_plane.py --ranks 8 --calls 200 --kill
    python scripts/bench_control_plane.py --threads 3 --ranks 4 --calls 60   # callers on threads
    python scripts/bench_control_plane.py --cluster 1x2,2x2,4x2,8x2,2x4,4x4 --calls 300
    python scripts/bench_control_plane.py --cluster 2x2,4x2,8x2 --fanout 2 --calls 300   # and a tree 2 wide
    python scripts/bench_control_plane.py --cluster 2x2,2x4,2x8 --data --calls 200      # a data call, per ranks per node
    python scripts/bench_control_plane.py --cluster 2x2,2x4,2x8 --later --calls 200     # a non-blocking call, read at once
    python scripts/bench_control_plane.py --scale 128x8,256x8,512x8,1024x8,1024x16,4096x8   # the controller alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402

PATHS = ("session", "ray")
TREE_PATHS = ("agent", "tree", "ray")  # --cluster with --fanout: flat agents, agents in a tree, Ray


def make_group(pool_nodes: list[int], mesh=None):
    """A group of ControlWorkers, ``pool_nodes[i]`` ranks on node entry ``i``, its session opened
    (``mesh``: its mesh, default ``dp`` = every rank)."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.control_workers import ControlWorker

    wg = RayWorkerGroup(RayResourcePool(pool_nodes, use_gpu=False), RayClassWithInitArgs(ControlWorker), mesh=mesh)
    wg.set_control("auto")
    wg.noop()  # opens the session (or the node agents)
    paths = set(wg._executor.control_paths())
    if paths == {"ray"}:
        raise SystemExit(f"no call session could be opened for a group on {pool_nodes}: {wg._executor.session_note}")
    return wg


def use(wg, path: str, fanout: int | None = None) -> str:
    """Switch ``wg`` to ``path`` (``session``/``agent``: the group's session or flat agents; ``tree``:
    agents ``fanout`` wide) and make one call (which opens agents restarted in a new tree); the path it reports."""
    from rankmesh.backends.ray.agent import AGENT_FANOUT

    if path == "ray":
        wg.set_control("ray")
    else:
        wg.set_control("auto", agent_fanout=fanout if path == "tree" else AGENT_FANOUT)
    wg.noop()
    reported = wg._executor.control_paths()[0]
    return "tree" if path == "tree" and reported == "agent" else reported


def pids(wg) -> list[int]:
    return [info["pid"] for info in wg._hosts.info]


def cpu_s(pid_list: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pid_list)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def block(wg, n: int, call=None) -> tuple[list[float], float, float, float]:
    """``n`` back-to-back calls of ``call()`` (default ``wg.noop()``): their round trips, the
    controller's CPU seconds (its process: Ray's threads too), the ranks' (all together), and the
    calling thread's alone (rankmesh's own work)."""
    call = call or wg.noop
    times = []
    ranks = pids(wg)
    ranks_cpu = cpu_s(ranks)
    cpu, own = time.process_time(), time.thread_time()
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    cpu, own = time.process_time() - cpu, time.thread_time() - own
    return times, cpu, cpu_s(ranks) - ranks_cpu, own


def skew(wg, samples: int) -> list[float]:
    """First to last rank entering ``stamp()`` (ms); the ranks share this machine's clock."""
    out = []
    for _ in range(samples):
        stamps = wg.stamp()
        out.append((max(stamps) - min(stamps)) / 1e6)
    return out


def measure(wg, label: dict, args: argparse.Namespace, idle: bool, paths: tuple[str, ...] = PATHS, call=None) -> list[dict]:
    """Every path of ``paths`` on one group, alternating by block (``call()`` each time, default a
    no-op): one row per path."""
    times = {p: [] for p in paths}
    cpu = {p: 0.0 for p in paths}
    own = {p: 0.0 for p in paths}
    ranks_cpu = {p: 0.0 for p in paths}
    skews = {p: [] for p in paths}
    reported = {}
    for path in paths:  # warm up
        use(wg, path, args.fanout)
        block(wg, args.block, call)
    for _ in range(max(1, args.calls // args.block)):
        for path in paths:
            reported[path] = use(wg, path, args.fanout)
            t, c, rc, o = block(wg, args.block, call)
            times[path] += t
            cpu[path] += c
            own[path] += o
            ranks_cpu[path] += rc
            skews[path] += skew(wg, 10)
    rows = []
    for path in paths:
        row = {**label, "path": reported[path], "p50_ms": 1e3 * statistics.median(times[path]),
               "p99_ms": 1e3 * pct(times[path], 0.99), "controller_cpu_ms": 1e3 * cpu[path] / len(times[path]),
               "controller_thread_ms": 1e3 * own[path] / len(times[path]),
               "ranks_cpu_ms": 1e3 * ranks_cpu[path] / len(times[path]),
               "skew_p50_ms": statistics.median(skews[path]), "skew_p99_ms": pct(skews[path], 0.99)}
        if idle:
            use(wg, path, args.fanout)
            after = []
            for _ in range(args.idle_samples):
                time.sleep(args.idle_s)
                start = time.perf_counter()
                wg.noop()
                after.append(time.perf_counter() - start)
            row["after_idle_ms"] = 1e3 * statistics.median(after)
            before = cpu_s(pids(wg))
            time.sleep(args.idle_cpu_s)
            row["idle_cpu_per_rank"] = (cpu_s(pids(wg)) - before) / args.idle_cpu_s / len(pids(wg))
        rows.append(row)
    return rows


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def kill_rank_drill() -> dict:
    """SIGKILL rank 1 of a 4-rank session group inside a 10 s call: how long until the call raises."""
    from rankmesh.errors import WorkerDiedError
    from tests.control_workers import kill_after

    before = shm()
    wg = make_group([4])
    killed = kill_after(pids(wg)[1], 0.5)
    try:
        wg.sleep(10.0)
        raise SystemExit("the call outlived its killed rank")
    except WorkerDiedError as exc:
        error_s = time.monotonic() - killed["at"]
        ranks = exc.ranks
    wg.shutdown()
    time.sleep(1.0)
    return {"error_after_s": error_s, "ranks": list(ranks), "dev_shm_new": sorted(shm() - before)}


CONTROLLER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.control_workers import ControlWorker
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ControlWorker))
    wg.noop()
    print(" ".join(str(i["pid"]) for i in wg._hosts.info), wg._executor.control_paths()[0], flush=True)
    time.sleep(600)
""")


def kill_controller_drill() -> dict:
    """SIGKILL a controller whose 4 ranks wait in their session: when each rank's session thread
    ends (its thread count drops, or its process is gone), and when Ray has stopped them all."""
    import ray

    before = shm()
    code = CONTROLLER.format(repo=str(REPO), address=ray.get_runtime_context().gcs_address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    ranks, path = [int(p) for p in line[:-1]], line[-1]
    threads = {p: psutil.Process(p).num_threads() for p in ranks}
    start = time.monotonic()
    proc.kill()
    proc.wait()
    left_loop: dict[int, float] = {}
    gone_after = None
    while time.monotonic() - start < 30 and gone_after is None:
        now = time.monotonic() - start
        alive = 0
        for p in ranks:
            try:
                fewer = psutil.Process(p).num_threads() < threads[p]
                alive += 1
            except psutil.NoSuchProcess:
                fewer = True
            if fewer:
                left_loop.setdefault(p, now)
        if not alive:
            gone_after = now
        time.sleep(0.01)
    time.sleep(1.0)
    return {"path": path, "session_threads_ended_after_s": max(left_loop.values()) if len(left_loop) == len(ranks) else None,
            "processes_gone_after_s": gone_after, "dev_shm_new": sorted(shm() - before)}


def fit(rows: list[dict], key: str) -> tuple[float, float, float]:
    """Least squares ``key ≈ a + b·nodes + c·ranks`` over ``rows``; returns (a, b, c) in ms."""
    import numpy as np

    x = np.array([[1.0, r["nodes"], r["ranks"]] for r in rows])
    y = np.array([r[key] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return tuple(float(c) for c in coef)


def print_rows(rows: list[dict], cluster: bool) -> None:
    first = f"{'nodes':>5} " if cluster else ""
    print(f"{first}{'ranks':>5} {'path':>8} {'p50 ms':>8} {'p99 ms':>8} {'ctl CPU ms':>10} {'ctl thread':>10} {'ranks CPU':>9} "
          f"{'skew p50':>9} {'skew p99':>9} {'after idle':>10} {'idle CPU/rank':>13}")
    for r in rows:
        idle = f"{r['after_idle_ms']:10.3f} {r['idle_cpu_per_rank']:13.2%}" if "after_idle_ms" in r else ""
        first = f"{r['nodes']:5d} " if cluster else ""
        print(f"{first}{r['ranks']:5d} {r['path']:>8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['controller_cpu_ms']:10.3f} "
              f"{r['controller_thread_ms']:10.3f} {r['ranks_cpu_ms']:9.3f} {r['skew_p50_ms']:9.3f} {r['skew_p99_ms']:9.3f} {idle}")


def one_node(args: argparse.Namespace) -> dict:
    from rankmesh.backends.ray.runtime import ensure_ray

    sizes = [int(n) for n in args.ranks.split(",") if n]
    ensure_ray(num_cpus=max(sizes) + 8, logging_level="ERROR", log_to_driver=False)
    rows = []
    for ranks in sizes:
        wg = make_group([ranks])
        try:
            rows += measure(wg, {"nodes": 1, "ranks": ranks}, args, idle=ranks == args.idle_ranks)
        finally:
            wg.shutdown()
    print("session: one message per call through the controller's shared-memory ring; ray: one Ray task per rank")
    print_rows(rows, cluster=False)
    for ranks in sizes:
        mine, ray_row = (next(r for r in rows if r["ranks"] == ranks and r["path"] == p) for p in PATHS)
        print(f"{ranks} ranks: session p50 {ray_row['p50_ms'] / mine['p50_ms']:.1f}x faster than Ray's; "
              f"controller CPU per call {mine['controller_cpu_ms']:.3f} ms vs {ray_row['controller_cpu_ms']:.3f} ms")
    out: dict = {"rows": rows}
    if args.kill:
        out["kill_rank"] = kill_rank_drill()
        out["kill_controller"] = kill_controller_drill()
        print("rank SIGKILLed mid-call:", json.dumps(out["kill_rank"]))
        print("controller SIGKILLed:", json.dumps(out["kill_controller"]))
    return out


def threads(args: argparse.Namespace) -> dict:
    """``--threads N``: N callers at once on one group (the first size of ``--ranks``): all but
    the last make blocking ``echo`` calls, the last non-blocking ``slow_append(i, 0)`` read at
    once, ``--calls`` each.  Each kind alone first, then all together: per caller p50, p90 and
    max, and the wall time together against the callers' time alone added up (1.0: no caller
    waits on another; the ranks run every call in turn, so under 1.0 is overlap)."""
    import threading

    from rankmesh.backends.ray.runtime import ensure_ray

    ranks = int(args.ranks.split(",")[0])
    ensure_ray(num_cpus=ranks + 8, logging_level="ERROR", log_to_driver=False)
    wg = make_group([ranks])
    kinds = {"blocking": lambda i: wg.echo(i), "non-blocking": lambda i: wg.slow_append(i, 0.0).get()}
    callers = ["blocking"] * (args.threads - 1) + ["non-blocking"]

    def run(kind: str, out: list[float]) -> None:
        for i in range(args.calls):
            start = time.perf_counter()
            kinds[kind](i)
            out.append(time.perf_counter() - start)

    def line(name: str, times: list[float]) -> dict:
        row = {"caller": name, "p50_ms": pct(times, 0.5) * 1e3, "p90_ms": pct(times, 0.9) * 1e3, "max_ms": max(times) * 1e3}
        print(f"{name:>22}  p50 {row['p50_ms']:8.2f} ms  p90 {row['p90_ms']:8.2f} ms  max {row['max_ms']:8.2f} ms")
        return row

    try:
        wg.echo(0), wg.slow_append(0, 0.0).get()
        print(f"{args.threads} callers, {args.calls} calls each, one group of {ranks} ranks on this node")
        rows, alone = [], {}
        for kind in dict.fromkeys(callers):
            times: list[float] = []
            run(kind, times)
            alone[kind] = sum(times)
            rows.append(line(f"{kind} alone", times))
        results: list[list[float]] = [[] for _ in callers]
        workers = [threading.Thread(target=run, args=(kind, out)) for kind, out in zip(callers, results)]
        start = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        wall = time.perf_counter() - start
        rows += [line(f"{kind} {i}, together", times) for i, (kind, times) in enumerate(zip(callers, results))]
        serial = sum(alone[kind] for kind in callers)
        print(f"together {wall:.2f} s against {serial:.2f} s one caller after another: {wall / serial:.2f}x")
    finally:
        wg.shutdown()
    return {"threads": rows, "together_s": wall, "one_after_another_s": serial}


def cluster(args: argparse.Namespace) -> dict:
    """Groups of ``n`` nodes x ``r`` ranks on a simulated cluster (the driver on the CPU-less head)."""
    from rankmesh.backends.ray.simulated import loopback_cluster

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.cluster.split(",") if shape]
    nodes_needed = max(n for n, _ in shapes)
    cpus = max(r for _, r in shapes)
    loopback_cluster([{"num_cpus": cpus, "object_store_memory": 96 << 20}] * nodes_needed, logging_level="ERROR")
    paths = TREE_PATHS if args.fanout else ("agent", "ray")
    rows = []
    for nodes, ranks_per_node in shapes:
        mesh, batch = None, None
        if args.data:  # a megatron data call: dp = nodes pieces whatever the ranks per node
            import torch

            from rankmesh.data import DataProto
            from rankmesh.mesh import RankMesh

            mesh = RankMesh(tp=ranks_per_node, dp=nodes)
            batch = DataProto.from_dict({"x": torch.arange(4 * nodes)})
        wg = make_group([ranks_per_node] * nodes, mesh)
        call = None
        if batch is not None:
            # Piece d (rows 4d..4d+3) comes back from dp rank d's collect rank, tp 0: rank d * ranks_per_node.
            expected = [x * 10 + d * ranks_per_node for d in range(nodes) for x in range(4 * d, 4 * d + 4)]
            assert wg.rows_megatron(batch).batch["y"].tolist() == expected
            call = functools.partial(wg.rows_megatron, batch)
        if args.later:
            assert wg.slow_append(0, 0.0).get() == [None] * (nodes * ranks_per_node)
            call = functools.partial(later_every, wg)
        try:
            rows += measure(wg, {"nodes": nodes, "ranks": nodes * ranks_per_node}, args, idle=False, paths=paths, call=call)
        finally:
            wg.shutdown()
    print("agent: one Ray task per node per call, each node's agent writes its ring; ray: one Ray task per rank")
    if args.fanout:
        print(f"tree: the agents in a tree {args.fanout} wide (the controller sends to {args.fanout}, each agent forwards to "
              f"{args.fanout})")
    print_rows(rows, cluster=True)
    out: dict = {"rows": rows, "models": {}}
    for path in paths:
        mine = [r for r in rows if r["path"] == path]
        for key in ("controller_cpu_ms", "p50_ms"):
            a, b, c = fit(mine, key)
            at_scale = a + b * 1024 + c * 8192
            out["models"][f"{path} {key}"] = {"a": a, "per_node": b, "per_rank": c, "1024x8": at_scale}
            print(f"{path:>5} {key:>17} ≈ {a:.3f} + {b:.3f}·nodes + {c:.3f}·ranks ms  -> 1,024 nodes x 8 ranks: "
                  f"{at_scale:.1f} ms (Monarch's cast: 5.76 ms p50)")
    if args.fanout:
        out["tree_model"] = tree_model([r for r in rows if r["path"] == "tree"], args.fanout)
    return out


def later_every(wg) -> None:
    """A non-blocking no-op call to every rank whose future holds every rank's output, read at once."""
    wg.slow_append(0, 0.0).get()


def tree_model(rows: list[dict], fanout: int) -> dict:
    """The tree's cost model, fitted to the tree rows: the controller's CPU per call
    ``a + b·tops + c·ranks`` (``tops``: the agents it sends to, at most ``fanout``; ``b``: one
    send; ``c``: its own work per rank, splitting and gathering).  Extrapolated to 1,024 nodes x 8
    ranks for fanouts 8 and 16: the controller's CPU, and when the last node gets its share (the
    controller's work, then ``depth`` levels that each send ``fanout`` tasks one after another),
    beside Monarch's 5.76 ms."""
    import numpy as np

    from rankmesh.backends.ray.agent import agent_tree

    def shape(nodes: int, f: int) -> tuple[int, int]:
        tops, children = agent_tree(list(range(nodes)), f)
        depth, level = 1, tops
        while any(children[n] for n in level):
            level = [c for n in level for c in children[n]]
            depth += 1
        return len(tops), depth

    x = np.array([[1.0, shape(r["nodes"], fanout)[0], r["ranks"]] for r in rows])
    y = np.array([r["controller_cpu_ms"] for r in rows])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    model: dict = {"a": float(a), "per_send": float(b), "per_rank": float(c)}
    print(f" tree controller_cpu_ms ≈ {a:.3f} + {b:.3f}·tops + {c:.3f}·ranks ms")
    for f in (8, 16):
        depth = shape(1024, f)[1]
        cpu = a + f * b + 8192 * c
        last = cpu + depth * f * b
        model[f"1024x8 fanout {f}"] = {"controller_cpu_ms": float(cpu), "depth": depth, "last_node_ms": float(last),
                                        "of_which_per_rank_ms": float(8192 * c)}
        print(f"tree fanout {f}, 1,024 nodes x 8 ranks: controller CPU ≈ {cpu:.1f} ms per call ({8192 * c:.1f} ms of it "
              f"per rank); {depth} levels; last node's share sent after ≈ {last:.1f} ms (Monarch's cast: 5.76 ms p50)")
    return model


# ----- --scale: the controller alone, against a thousand in-process nodes ------------------------


class InstantAgents:
    """In-process stand-ins for a group's node agents, whose ranks answer at once (one per top agent:
    :meth:`handle`), with the bookkeeping they share.

    Each stands behind a top node's agent handle: ``handle.call.remote(call_id, method, headers,
    refs, key, plans, ...)`` returns what a real agent's call returns, the ObjectRef of a
    :class:`~rankmesh.backends.ray.agent.NodeAnswer` (put with ``ray.put``, so that the
    controller reads it through Ray, as it reads a real answer).  Its ranks all finish at once:
    no failure, nothing late.  A rank whose share asks for its output answers ``None`` to a call
    without a batch (a no-op) and, to a data call (a batch inline or in the store), a one-row
    ``DataProto`` inside the answer (as a real agent answers an output under ``agent.INLINE_BYTES``).  What a stand-in
    spends is an agent's work, not the controller's: it is counted in ``spent_s`` (the calling
    thread's CPU) and taken off the controller's.  ``shares`` keeps the last calls' arguments, to
    time real sends of them (:func:`send_cost_ms`).
    """

    def __init__(self, ranks_of: dict) -> None:
        self.ranks_of = ranks_of  # node -> its ranks, reader order
        self.spent_s = 0.0
        self.shares: list = []
        self.outputs: dict[bytes, bool] = {}  # header -> whether its rank sends an output

    def handle(self, node: str) -> "InstantAgent":
        return InstantAgent(self)


class InstantAgent:
    """One top agent's stand-in (see :class:`InstantAgents`): it keeps the plans of its subtree by key."""

    def __init__(self, shared: InstantAgents) -> None:
        self.shared = shared
        self.routes: dict = {}
        self.call = self  # handle.call.remote(...)
        self.submit = InstantSubmit(self)  # handle.submit.remote(...): a non-blocking call

    def remote(self, call_id: int, method: str, headers: tuple, refs: tuple, key, plans, timeout_s, generation: int = 0):
        import ray

        from rankmesh.backends.ray.agent import NodeAnswer

        shared = self.shared
        start = time.thread_time()
        ref = ray.put(NodeAnswer(self.values(headers, key, plans)))
        shared.shares.append((call_id, method, headers, refs, key, plans, timeout_s, generation))
        del shared.shares[:-64]
        shared.spent_s += time.thread_time() - start
        return ref

    def values(self, headers: tuple, key, plans) -> dict:
        """The subtree's outputs that are not ``None``, as a real agent answers them (see the class)."""
        import pickle

        import torch

        from rankmesh.backends.ray.wire import SharedSlot
        from rankmesh.data import DataProto

        shared = self.shared
        if plans is not None and key is not None:
            self.routes[key] = plans
        values = {}
        sends = [shared.outputs.get(h) for h in headers]
        for i, h in enumerate(headers):
            if sends[i] is None:  # a data call's share (a batch inline, or in the store) that sends an output
                call = pickle.loads(h)
                data = any(isinstance(a, (DataProto, SharedSlot)) for a in (*call.args, *call.kwargs.values()))
                sends[i] = shared.outputs[h] = data and call.return_output
        if any(sends):  # every rank whose share sends an output answers one row
            for node, plan in (plans if plans is not None else self.routes[key]).items():
                for rank, share in zip(shared.ranks_of[node], plan):
                    if share is not None and sends[share]:  # small: inside the answer, as a real agent sends it
                        values[rank] = DataProto.from_dict({"y": torch.zeros(1)})
        return values


class InstantSubmit:
    """A top agent stand-in's :meth:`~rankmesh.backends.ray.agent.NodeAgent.submit`, answered at
    once, the outputs already there (a one-row ``DataProto`` each, put here): the ObjectRef of its
    subtree's ``{rank: output ref}``, of the ranks whose share answers (``answering``) when given,
    else of every rank called; or, ``joined``, of a :class:`~rankmesh.backends.ray.agent.Joined`,
    as a real agent answers a call whose future reads every rank (its subtree's answer, put as
    :meth:`InstantAgent.remote` puts one, and where each rank's output is)."""

    def __init__(self, agent: InstantAgent) -> None:
        self.agent = agent

    def remote(self, call_id: int, method: str, headers: tuple, refs: tuple, key, plans, timeout_s, generation: int = 0,
               answering=None, joined: bool = False):
        import ray
        import torch

        from rankmesh.data import DataProto

        agent, shared = self.agent, self.agent.shared
        start = time.thread_time()
        if plans is not None and key is not None:
            agent.routes[key] = plans
        row = ray.put(DataProto.from_dict({"y": torch.zeros(1)}))
        outputs = {rank: row for node, plan in (plans if plans is not None else agent.routes[key]).items()
                   for rank, share in zip(shared.ranks_of[node], plan)
                   if share is not None and (answering is None or answering[share])}
        if joined:
            from rankmesh.backends.ray.agent import Joined, NodeAnswer, SubtreeOutputs

            answer = ray.put(NodeAnswer(agent.values(headers, key, plans)))
            ref = ray.put(Joined(answer, ray.put(SubtreeOutputs(outputs))))
        else:
            ref = ray.put(outputs)
        shared.spent_s += time.thread_time() - start
        return ref


def scale_group(nodes: int, per_node: int, fanout: int, mesh=None):
    """A RayWorkerGroup of ``nodes`` x ``per_node`` ranks of ControlWorker on the agent path, every
    agent an :class:`InstantAgents`: the real group, executor and agent session, no process started.
    ``mesh``: the group's mesh (default ``RankMesh(dp=nodes * per_node)``)."""
    from rankmesh.backends.ray import RayWorkerGroup
    from rankmesh.backends.ray.agent import AgentSession
    from rankmesh.backends.ray.hosts import HostSet
    from rankmesh.binding import MethodTable
    from rankmesh.mesh import RankMesh
    from tests.control_workers import ControlWorker

    world = nodes * per_node
    node_ids = [f"{n:056x}" for n in range(nodes)]  # Ray's node ids: 56 hex digits
    info = [{"rank": r, "pid": 1_000_000 + r, "node_id": node_ids[r // per_node],
             "node_ip": f"10.{r // per_node // 250}.{r // per_node % 250}.{1 + r % per_node}"} for r in range(world)]
    hosts = HostSet(actors=[None] * world, names=[f"scale_{r}" for r in range(world)], info=info, name_prefix="scale",
                    detached=False)
    table = MethodTable.build(ControlWorker, world, mesh or RankMesh(dp=world), group_type=RayWorkerGroup)
    executor, recovery = RayWorkerGroup._drive(hosts, table)
    session = AgentSession(hosts.actors, [i["pid"] for i in info], [i["node_id"] for i in info], hosts.nodes,
                           executor.coords, fanout)
    agents = InstantAgents(session.by_node)
    session.agents = {node: agents.handle(node) for node in session.by_node}
    executor.session = session
    return RayWorkerGroup._over(hosts, table, executor, recovery), agents, len(session.tops)


def send_cost_ms(sink, shares: list, repeat: int = 50) -> float:
    """The controller's CPU for one real Ray task carrying one of ``shares`` to ``sink``, a live node
    agent serving no node (ms, the calling thread's): what the in-process stand-ins leave out of
    each send to a top agent."""
    import ray

    # The sink serves no node: it answers a call with no selection key and empty plans at once.
    shares = [(call_id, method, headers, refs, None, {} if plans is None else plans, timeout_s, generation)
              for call_id, method, headers, refs, _, plans, timeout_s, generation in shares]
    start = time.thread_time()
    refs = [sink.call.remote(*shares[i % len(shares)]) for i in range(repeat)]
    spent = time.thread_time() - start
    ray.get(refs)
    return spent / repeat * 1000


def scale_mesh(nodes: int, per_node: int, dp: int | None):
    """The megatron mesh of the ``--dp`` call at one shape: ``tp`` = the ranks per node, ``pp`` the
    rest, ``dp`` pieces (``None`` when ``dp`` does not divide the shape)."""
    from rankmesh.mesh import RankMesh

    world = nodes * per_node
    if dp is None or world % (dp * per_node):
        return None
    return RankMesh(tp=per_node, pp=world // (dp * per_node), dp=dp)


def controller_ms(agents, call, calls: int) -> tuple[float, float]:
    """The controller's own CPU per call of ``call()``, and the stand-in agents' (ms, the calling thread's)."""
    start, spent = time.thread_time(), agents.spent_s
    for _ in range(calls):
        call()
    stand_in = agents.spent_s - spent
    return (time.thread_time() - start - stand_in) / calls * 1000, stand_in / calls * 1000


def scale_batch(dp: int, piece_kib: int):
    """The ``--dp`` data call's batch: one row per dp piece, each row ``piece_kib`` KiB of float64
    (0: one number a row, a piece small enough to ride inside the call)."""
    import torch

    from rankmesh.data import DataProto

    if not piece_kib:
        return DataProto.from_dict({"x": torch.arange(dp)})
    return DataProto.from_dict({"x": torch.arange(dp, dtype=torch.float64).unsqueeze(1).repeat(1, piece_kib * 128)})


def ray_floor_ms(dp: int, piece_kib: int = 0, repeat: int = 20) -> float:
    """What Ray's store costs the controller for the ``dp`` pieces of :func:`scale_batch`: a
    ``ray.put`` of each (ms, the calling thread's CPU).  The group sends pieces up to 100 KiB inside
    the call's headers instead; a piece over that pays this put."""
    import ray

    pieces = scale_batch(dp, piece_kib).chunk(dp)
    start = time.thread_time()
    for _ in range(repeat):
        refs = [ray.put(piece) for piece in pieces]
    del refs
    return (time.thread_time() - start) / repeat * 1000


def scale(args: argparse.Namespace) -> dict:
    """The controller's CPU per call at ``--scale`` shapes, with in-process agents.

    Four calls: a no-op ``ONE_TO_ALL`` call to every rank, and (``--dp N``), on a mesh ``tp`` =
    ranks per node, ``dp`` = N: a ``MEGATRON_COMPUTE`` call with one inline value per dp rank
    (each dp piece one share, with and without an output), a ``MEGATRON_COMPUTE_PROTO`` call
    with a ``DataProto`` of one row per dp rank (each piece put in the store once; each collect
    rank's output fetched from the store), and the same call non-blocking, its future read at once
    (the agents answer their collect ranks' output references: :class:`InstantSubmit`).  Real code: the group's split and collect,
    the executor's call record, the agent session's shares and sends, and the wait loop reading
    the answers through Ray.  Left out: the network, every agent's and rank's own CPU, and Ray's
    background threads in the controller (only the calling thread's CPU is counted).  Each send
    to a top agent is an in-process call here; the CPU of a real one, measured in the same run
    against a live actor with the same share, is added per top agent.
    """
    import ray

    from rankmesh.backends.ray.agent import start_agents
    from rankmesh.backends.ray.runtime import ensure_ray

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.scale.split(",") if shape]
    ensure_ray(num_cpus=2, logging_level="ERROR", log_to_driver=False)
    fanout = args.fanout or 8
    sink = next(iter(start_agents([ray.get_runtime_context().get_node_id()]).values()))
    ray.get(sink.call.remote(0, "warm-up", (), (), None, {}, None, 0))  # started, and the method exported
    rows = []
    for nodes, per_node in shapes:
        mesh = scale_mesh(nodes, per_node, args.dp)
        wg, agents, tops = scale_group(nodes, per_node, fanout, mesh)
        assert wg.noop() == [None] * (nodes * per_node)  # every rank answered, through the real collect
        calls = min(args.calls, max(3, int(2e6 // (nodes * per_node))))
        own, stand_in = controller_ms(agents, wg.noop, calls)
        send = send_cost_ms(sink, agents.shares[-tops:])
        row = {"nodes": nodes, "ranks": nodes * per_node, "per_node": per_node, "tops": tops, "calls": calls,
               "controller_in_process_ms": own, "send_ms": send, "controller_cpu_ms": own + tops * send,
               "agents_stand_in_ms": stand_in}
        line = (f"{nodes:5d} x {per_node:2d} = {nodes * per_node:6d} ranks: controller CPU per no-op call "
                f"{row['controller_cpu_ms']:7.2f} ms = {own:6.2f} in process + {tops} sends x {send:.2f} ms")
        # The no-op non-blocking, its future (every rank's output) read at once: the agents answer joined.
        assert len(wg.slow_append(0, 0.0).get()) == nodes * per_node
        own_every, _ = controller_ms(agents, functools.partial(later_every, wg), calls)
        row["every_later_cpu_ms"] = own_every + tops * send
        line += f"; non-blocking {row['every_later_cpu_ms']:7.2f} ms"
        if mesh is not None:
            values = list(range(args.dp))
            batch = scale_batch(args.dp, args.piece_kib)  # one row per dp piece
            assert wg.shifted(values) == [None] * args.dp  # one output per dp rank (the stand-ins answer None)
            assert len(wg.rows_megatron(batch)) == args.dp  # one row back per dp piece, through the real concat
            assert len(wg.rows_megatron_later(batch).get()) == args.dp  # the same, non-blocking, read at once
            for key, call in (("megatron", lambda: wg.shifted(values)), ("proto", lambda: wg.rows_megatron(batch)),
                              ("later", lambda: wg.rows_megatron_later(batch).get())):
                own_call, _ = controller_ms(agents, call, calls)
                send_call = send_cost_ms(sink, agents.shares[-tops:])
                row.update({"dp": args.dp, f"{key}_in_process_ms": own_call, f"{key}_send_ms": send_call,
                            f"{key}_cpu_ms": own_call + tops * send_call})
            line += (f"; {args.dp} dp pieces: MEGATRON_COMPUTE {row['megatron_cpu_ms']:6.2f} ms, "
                     f"MEGATRON_COMPUTE_PROTO {row['proto_cpu_ms']:6.2f} ms, non-blocking {row['later_cpu_ms']:6.2f} ms")
        rows.append(row)
        print(line + f" ({calls} calls)", flush=True)
    ray.kill(sink)
    out: dict = {"rows": rows}
    if args.dp:
        out["ray_floor_ms"] = ray_floor_ms(args.dp, args.piece_kib)
        size = f"{args.piece_kib} KiB" if args.piece_kib else "one-row"
        how = ("each is put, as here: the rest of the call is what the column after the puts shows" if args.piece_kib > 100
               else "the call sends these pieces inside its headers instead (up to 100 KiB a piece)")
        print(f"The same {size} pieces through Ray's store: {args.dp} ray.put, {out['ray_floor_ms']:.1f} ms of the "
              f"controller's CPU (same run); {how}")
        if args.piece_kib > 100:
            for row in rows:
                if "proto_cpu_ms" in row:
                    row["proto_after_puts_ms"] = row["proto_cpu_ms"] - out["ray_floor_ms"]
                    print(f"{row['nodes']:5d} x {row['per_node']:2d}: MEGATRON_COMPUTE_PROTO {row['proto_cpu_ms']:.2f} ms "
                          f"= {out['ray_floor_ms']:.2f} ms of puts + {row['proto_after_puts_ms']:.2f} ms of the rest")
    kinds = (("controller_cpu_ms", "no-op", "fit", 10), ("every_later_cpu_ms", "no-op non-blocking", "fit_every_later", None),
             ("megatron_cpu_ms", f"MEGATRON_COMPUTE dp={args.dp}", "fit_megatron", None),
             ("proto_cpu_ms", f"MEGATRON_COMPUTE_PROTO dp={args.dp}", "fit_proto", 30),
             ("later_cpu_ms", f"MEGATRON_COMPUTE_PROTO non-blocking dp={args.dp}", "fit_later", None))
    for key, what, name, target in kinds:
        measured = [r for r in rows if key in r]
        if len(measured) >= 3:
            a, b, c = fit(measured, key)
            out[name] = {"a": a, "per_node": b, "per_rank": c}
            print(f"{what}: controller CPU ≈ {a:.3f} + {b:.4f}·nodes + {c:.4f}·ranks ms "
                  f"(1,024 x 8: {a + b * 1024 + c * 8192:.1f} ms" + (f"; target: {target} ms)" if target else ")"))
    by_shape = {(r["nodes"], r["per_node"]): r for r in rows}
    for (nodes, per_node), row in by_shape.items():
        double = by_shape.get((nodes, 2 * per_node))
        if double:
            for key, what, _, _ in kinds:
                if key in row and key in double:
                    change = double[key] / row[key] - 1
                    print(f"{nodes} nodes, {per_node} -> {2 * per_node} ranks per node, {what.rsplit(' dp=', 1)[0]}: controller "
                          f"CPU {change:+.0%} (target: under 10 %)")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8,16", help="group sizes on this node (default 1,2,4,8,16)")
    ap.add_argument("--cluster", help="instead: shapes NODESxRANKS on a simulated cluster, e.g. 1x2,2x2,4x2,8x2,2x4,4x4")
    ap.add_argument("--calls", type=int, default=1000, help="calls per path and group size")
    ap.add_argument("--block", type=int, default=100, help="calls per block; the paths alternate by block")
    ap.add_argument("--idle-ranks", type=int, default=8, help="group size whose idle figures are measured")
    ap.add_argument("--idle-s", type=float, default=1.0, help="idleness before each 'after idle' call")
    ap.add_argument("--idle-samples", type=int, default=5)
    ap.add_argument("--idle-cpu-s", type=float, default=10.0, help="how long the ranks' idle CPU is measured")
    ap.add_argument("--fanout", type=int, help="with --cluster: also measure the agents in a tree this wide")
    ap.add_argument("--data", action="store_true", help="with --cluster: time a MEGATRON_COMPUTE_PROTO call (mesh tp = "
                    "ranks per node, dp = nodes, 4 rows per piece) instead of a no-op")
    ap.add_argument("--later", action="store_true", help="with --cluster: time a non-blocking no-op call to every rank, "
                    "its future read at once (slow_append(0, 0).get(): a GroupFuture of every rank's output)")
    ap.add_argument("--kill", action="store_true", help="also run the SIGKILL drills (one node)")
    ap.add_argument("--scale", help="instead: the controller alone at shapes NODESxRANKS (e.g. 1024x8,4096x8) against "
                                    "in-process agents whose ranks answer at once (--fanout: the tree's width, default 8)")
    ap.add_argument("--dp", type=int, help="with --scale: also MEGATRON_COMPUTE(_PROTO) calls with this many dp pieces")
    ap.add_argument("--piece-kib", type=int, default=0, help="with --scale --dp: each data piece this many KiB (default: "
                    "one number, small enough to ride inside the call; over 100 each piece is put in the store)")
    ap.add_argument("--threads", type=int, help="instead: this many callers at once on one group of the first --ranks "
                    "(the last non-blocking), against each kind alone")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 2:
        ap.error(f"--threads: at least 2 callers, got {args.threads}")
    out = (scale(args) if args.scale else cluster(args) if args.cluster else threads(args) if args.threads
           else one_node(args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
