#!/usr/bin/env python
"""How the Ray backend's costs grow with world size and node count.

For each cluster (simulated nodes on 127.0.0.1 by default, namespaced nodes with ``--netns``, or
a real cluster with ``--address``) and each world size, start a RayWorkerGroup spread evenly over the nodes and measure:

* ``start_s``: starting the group.  With ``--fresh`` each group is started from scratch (pool,
  processes, imports, worker ``__init__``).  By default, to keep the run short on small machines,
  each cluster starts the processes of its largest group once (the launch time is printed) and
  every world size builds its workers on an even subset of them: ``start_s`` is then the build
  time only (marked ``*`` in the table);
* ``noop_ms``: one ONE_TO_ALL call of a method that does nothing (dispatch round trip);
* ``small_ms`` / ``large_ms``: one DP_COMPUTE_PROTO echo of a 1 MiB / 64 MiB batch (split over
  the ranks, sent back, concatenated), and the bandwidth it implies.

Prints a table, writes a PNG plot (``--plot``) and optionally JSON (``--json PATH`` or ``-``).

    python scripts/scaling_test.py                      # simulated 1, 2 and 4 nodes, world 1..16
    python scripts/scaling_test.py --quick              # a smoke run (under a minute)
    python scripts/scaling_test.py --address auto --nodes 1,2,4 --world-sizes 8,16,32 --gpu
    sudo python scripts/scaling_test.py --netns 2x2,4x1      # each node its own network namespace

With ``--netns NODESxRANKS,...`` each shape gets a cluster of its own (``rankmesh.testing.cluster``:
every node a network namespace with its own address on one private bridge, a CPU-less head, as
many CPUs per node as ranks), and this script runs again inside the head's namespace against it,
with the group spread over the nodes: the figures then include a real network stack per hop
(veth and bridge), not one loopback.  It needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


MIB = 1 << 20


@dataclass
class Row:
    nodes: int
    world_size: int
    process_on_nodes: list[int]
    start_s: float
    noop_ms: float
    small_ms: float
    large_ms: float
    small_mib: float
    large_mib: float
    fresh: bool = True

    @property
    def large_gbps(self) -> float:
        return self.large_mib / 1024 / (self.large_ms / 1000) if self.large_ms else float("nan")


def _bench_worker():
    """The benchmark worker class (built here so that ``--help`` needs no torch/ray import)."""
    from rankmesh.data import DataProto
    from rankmesh.dispatch import Dispatch, register
    from rankmesh.worker import Worker

    class BenchWorker(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data: DataProto) -> DataProto:
            return data

    return BenchWorker


def make_batch(mib: float, rows: int = 1024):
    import torch

    from rankmesh.data import DataProto

    cols = max(1, int(mib * MIB / 4 / rows))
    return DataProto.from_dict({"x": torch.randn(rows, cols)})


def spread(world: int, nodes: int) -> list[int]:
    """``world`` processes over at most ``nodes`` nodes, as evenly as possible."""
    used = min(world, nodes)
    return [world // used + (1 if i < world % used else 0) for i in range(used)]


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def calls(wg, args: argparse.Namespace) -> tuple[float, float, float]:
    small, large = make_batch(args.small_mib), make_batch(args.large_mib)
    noop = timed(wg.noop, args.repeats, warmup=3)
    small_ms = timed(lambda: wg.echo(small), args.repeats)
    large_ms = timed(lambda: wg.echo(large), max(3, args.repeats // 2))
    return noop, small_ms, large_ms


def measure_fresh(nodes: int, world: int, args: argparse.Namespace) -> Row:
    """Start a group from scratch, measure, shut it down."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    counts = spread(world, nodes)
    start = time.perf_counter()
    pool = RayResourcePool(counts, use_gpu=args.gpu, ready_timeout=args.ready_timeout)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(_bench_worker()))
    start_s = time.perf_counter() - start
    try:
        noop, small_ms, large_ms = calls(wg, args)
    finally:
        wg.shutdown()
    return Row(nodes, world, counts, start_s, noop, small_ms, large_ms, args.small_mib, args.large_mib)


def subset(hosts, world: int, nodes: int):
    """The hosts of an even ``world``-rank spread over the first nodes of a launched host set."""
    import ray

    from rankmesh.backends.ray.hosts import HostSet
    from rankmesh.placement import Placement

    by_node: dict[int, list[int]] = {}
    for rank, place in enumerate(hosts.places):
        by_node.setdefault(place.node, []).append(rank)
    counts = spread(world, nodes)
    ranks = [r for node, count in zip(sorted(by_node), counts) for r in by_node[node][:count]]
    actors = [hosts.actors[r] for r in ranks]
    sub = HostSet(
        actors=actors,
        names=[hosts.names[r] for r in ranks],
        info=[hosts.info[r] for r in ranks],
        name_prefix=f"{hosts.name_prefix}-w{world}",
        detached=False,
    )
    sub.places = Placement(counts).places()
    sub.master = tuple(ray.get(actors[0].reserve_master_port.remote()))
    return sub, counts


def measure_reused(nodes: int, sizes: list[int], args: argparse.Namespace) -> list[Row]:
    """Launch the largest group's processes once; build and measure each world size on a subset."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.hosts import launch_hosts

    start = time.perf_counter()
    pool = RayResourcePool(spread(max(sizes), nodes), use_gpu=args.gpu, ready_timeout=args.ready_timeout)
    pool.acquire()
    hosts = launch_hosts(pool, f"scaling-{nodes}n", False, {}, 600.0)
    hosts.pool = pool
    print(f"# {nodes} node(s): launched {len(hosts.actors)} processes in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    try:
        for world in sizes:
            sub, counts = subset(hosts, world, nodes)
            start = time.perf_counter()
            wg = RayWorkerGroup.on_hosts(sub, RayClassWithInitArgs(_bench_worker()))
            build_s = time.perf_counter() - start
            noop, small_ms, large_ms = calls(wg, args)
            wg.release_hosts()
            row = Row(nodes, world, counts, build_s, noop, small_ms, large_ms, args.small_mib, args.large_mib, fresh=False)
            print(format_row(row), flush=True)
            rows.append(row)
    finally:
        hosts.shutdown()
    return rows


def simulated_cluster(nodes: int, cpus_per_node: int, store_mib: int):
    """A Cluster of ``nodes`` raylets on 127.0.0.1 (plus a CPU-less head), and a connection to it."""
    from rankmesh.backends.ray.simulated import loopback_cluster

    cluster, _ = loopback_cluster(
        [
            {"num_cpus": cpus_per_node, "resources": {f"sim_node_{i}": 1}, "object_store_memory": store_mib * MIB}
            for i in range(nodes)
        ],
        head_args={"object_store_memory": store_mib * MIB},
    )
    return cluster


def run(args: argparse.Namespace) -> list[Row]:
    import ray

    from rankmesh.errors import ResourcePoolError
    from rankmesh.testing.cluster import ADDRESS_ENV

    rows: list[Row] = []
    for nodes in args.nodes:
        sizes = [w for w in args.world_sizes if w >= nodes or nodes == 1]
        if not sizes:
            continue
        cluster = None
        if args.address and ADDRESS_ENV in os.environ:  # inside a namespaced cluster (--netns): bind its address
            ray.init(address=args.address, _node_ip_address=os.environ[ADDRESS_ENV], logging_level="ERROR")
        elif args.address:
            from rankmesh.backends.ray import ensure_ray

            ensure_ray(address=args.address)
        else:
            cluster = simulated_cluster(nodes, math.ceil(max(sizes) / nodes), args.store_mib)
        try:
            if args.fresh:
                for world in sizes:
                    try:
                        rows.append(measure_fresh(nodes, world, args))
                    except ResourcePoolError as exc:
                        print(f"# {nodes} node(s), world {world}: skipped, does not fit: {exc.args[0].splitlines()[0]}")
                        continue
                    print(format_row(rows[-1]), flush=True)
            else:
                try:
                    rows.extend(measure_reused(nodes, sizes, args))
                except ResourcePoolError as exc:
                    print(f"# {nodes} node(s): skipped, world {max(sizes)} does not fit: {exc.args[0].splitlines()[0]}")
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    return rows


def run_netns(args: argparse.Namespace) -> list[Row]:
    """Each ``--netns`` shape on a namespaced cluster of its own; this script, run inside it, measures."""
    from rankmesh.testing.cluster import NetnsCluster

    rows: list[Row] = []
    repo = Path(__file__).resolve().parents[1]
    pythonpath = os.pathsep.join(p for p in (str(repo / "src"), str(repo), os.environ.get("PYTHONPATH", "")) if p)
    for nodes, per_node in args.netns:
        spec = {"num_cpus": per_node, "object_store_memory": args.store_mib * MIB}
        with NetnsCluster(nodes=[spec] * nodes, lifetime_s=3600) as cluster:
            out = cluster.temp_dir / "rows.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--address", cluster.address, "--nodes", str(nodes),
                    "--world-sizes", str(nodes * per_node), "--repeats", str(args.repeats),
                    "--small-mib", str(args.small_mib), "--large-mib", str(args.large_mib),
                    "--store-mib", str(args.store_mib), "--ready-timeout", str(args.ready_timeout),
                    "--plot", str(cluster.temp_dir / "plot.png"), "--json", str(out), *(["--fresh"] if args.fresh else [])]
            proc = cluster.run(argv, timeout=args.netns_timeout, cwd=repo, env={"PYTHONPATH": pythonpath},
                               capture_output=False, stdout=subprocess.PIPE)
            got = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith(("nodes", "plot:", "*"))]
            print("\n".join(got), flush=True)
            if proc.returncode != 0 or not out.exists():
                print(f"# netns {nodes}x{per_node}: the run inside the cluster failed (exit {proc.returncode})")
                continue
            rows.extend(Row(**{k: v for k, v in r.items() if k != "large_gbps"}) for r in json.loads(out.read_text()))
    return rows


def header(args: argparse.Namespace) -> str:
    small, large = f"{args.small_mib:g}MiB ms", f"{args.large_mib:g}MiB ms"
    return f"{'nodes':>5} {'world':>5} {'per node':>14} {'start s':>8} {'noop ms':>8} {small:>9} {large:>10} {'GB/s':>6}"


def format_row(row: Row) -> str:
    counts = ",".join(map(str, row.process_on_nodes))
    return (
        f"{row.nodes:>5} {row.world_size:>5} {counts:>14} {row.start_s:>7.3f}{' ' if row.fresh else '*'} {row.noop_ms:>8.2f} "
        f"{row.small_ms:>9.2f} {row.large_ms:>10.1f} {row.large_gbps:>6.2f}"
    )


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("start_s", "group start (s)" if rows[0].fresh else "worker build on running processes (s)"),
        ("noop_ms", "noop ONE_TO_ALL (ms)"),
        ("small_ms", f"echo {rows[0].small_mib:g} MiB DP_COMPUTE_PROTO (ms)"),
        ("large_ms", f"echo {rows[0].large_mib:g} MiB DP_COMPUTE_PROTO (ms)"),
    ]
    for ax, (field, label) in zip(axes, panels):
        for nodes in sorted({r.nodes for r in rows}):
            pts = [(r.world_size, getattr(r, field)) for r in rows if r.nodes == nodes]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{nodes} node(s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size")
        ax.set_title(label, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    shapes = lambda text: [tuple(int(v) for v in shape.split("x")) for shape in text.split(",") if shape]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="join this Ray cluster instead of simulating nodes ('auto' works)")
    p.add_argument("--nodes", type=ints, default=[1, 2, 4], help="node counts to spread over (default 1,2,4)")
    p.add_argument("--world-sizes", type=ints, default=[1, 2, 4, 8, 16], help="world sizes (default 1,2,4,8,16)")
    p.add_argument("--gpu", action="store_true", help="one GPU per process (real clusters)")
    p.add_argument("--small-mib", type=float, default=1.0)
    p.add_argument("--large-mib", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    p.add_argument("--store-mib", type=int, default=512, help="object store per simulated node")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--plot", type=Path, default=Path("out/scaling.png"))
    p.add_argument("--json", default=None, help="write results as JSON to this path ('-' for stdout)")
    p.add_argument("--fresh", action="store_true", help="start every group from scratch (slower, measures process start)")
    p.add_argument("--quick", action="store_true", help="smoke run: nodes 1,2; world 1,2; small batches")
    p.add_argument("--netns", type=shapes, default=None,
                   help="instead: namespaced clusters NODESxRANKS, e.g. 2x2,4x1 (a network namespace per node; root)")
    p.add_argument("--netns-timeout", type=float, default=1800.0, help="seconds one --netns shape may take")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.world_sizes, args.repeats, args.large_mib = [1, 2], [1, 2], 3, 4.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(header(args), flush=True)
    started = time.perf_counter()
    rows = run_netns(args) if args.netns else run(args)
    where = (f"Ray cluster {args.address}" if args.address else
             "namespaced nodes (a network stack each)" if args.netns else "simulated nodes on 127.0.0.1")
    title = f"rankmesh Ray backend scaling ({where}, {os.cpu_count()} CPUs on this host)"
    if not rows:
        print("nothing measured")
        return 1
    plot(rows, args.plot, title)
    if not args.fresh:
        print("* build time of the workers on already running processes (see the '# launched' lines)")
    print(f"plot: {args.plot}  ({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        payload = json.dumps([{**asdict(r), "large_gbps": r.large_gbps} for r in rows], indent=2)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
