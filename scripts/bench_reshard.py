"""Benchmark: refit a generator's layout from a trainer's, by rankmesh's reshard plan vs the naive way.

The model is a few transformer layers of a 300M-parameter GPT shape (hidden 1024, ffn 4096, fused
QKV with partition stride 3), random weights, laid out over a trainer mesh (default tp2·pp2·dp2)
and refit into each generator mesh (default tp1·dp8, then tp4·dp2), on local Ray CPU processes.

* **reshard, direct** (``transport="auto"``, the default): ``rankmesh.reshard.reshard`` with
  ``plan_reshard``'s plan; every rank is on this one node, so each destination reads its regions
  straight out of the source processes (``process_vm_readv``): one copy per byte, no object store.
* **reshard, object store** (``transport="store"``): each source rank puts its regions into the
  object store once; each destination fetches only its own (two copies per byte).
* **naive**: gather every full tensor to the controller (one dp replica's shards), then send each
  destination rank its slice.

Printed per destination mesh: bytes moved (plan, naive, and the minimum: the bytes destination
ranks keep), the median time of each way over ``--repeat`` runs (the ways alternate run by run;
``--transport auto|store`` times one transport only), each reshard's ratio to naive, its stages
(until the last source has put or published; the rest of the receive; the slowest destination's
copying into place, which overlaps both), the bytes read directly and put into the store, and the
max bytes one source rank sends.  The plan is timed (median of 3) before any worker starts.  Every
way must leave identical weights on every destination rank (checked by checksum).

    python scripts/bench_reshard.py                        # 8 + 8 ranks, ~200 MB model, direct and store vs naive
    python scripts/bench_reshard.py --src tp=2,pp=2 --dst tp=1,dp=4 --dst tp=4   # 4 + 4 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.megatron.layouts import MegatronReshardWorker  # noqa: E402
from rankmesh.reshard import ParamLayout, local_shape, plan_reshard, reshard, shard_intervals  # noqa: E402

MIB = 1024 * 1024


def gpt_layers(layers: int, hidden: int, ffn: int, pp: int) -> list[ParamLayout]:
    """Megatron GPT layer parameters (global names), layers spread evenly over ``pp`` stages."""
    out = []
    for i in range(layers):
        stage, p = i * pp // layers, f"decoder.layers.{i}."
        out += [
            ParamLayout(p + "input_layernorm.weight", (hidden,), pp_stage=stage),
            ParamLayout(p + "self_attention.linear_qkv.weight", (3 * hidden, hidden), tp_dim=0, tp_stride=3, pp_stage=stage),
            ParamLayout(p + "self_attention.linear_qkv.bias", (3 * hidden,), tp_dim=0, tp_stride=3, pp_stage=stage),
            ParamLayout(p + "self_attention.linear_proj.weight", (hidden, hidden), tp_dim=1, pp_stage=stage),
            ParamLayout(p + "self_attention.linear_proj.bias", (hidden,), pp_stage=stage),
            ParamLayout(p + "pre_mlp_layernorm.weight", (hidden,), pp_stage=stage),
            ParamLayout(p + "mlp.linear_fc1.weight", (ffn, hidden), tp_dim=0, pp_stage=stage),
            ParamLayout(p + "mlp.linear_fc1.bias", (ffn,), tp_dim=0, pp_stage=stage),
            ParamLayout(p + "mlp.linear_fc2.weight", (hidden, ffn), tp_dim=1, pp_stage=stage),
            ParamLayout(p + "mlp.linear_fc2.bias", (hidden,), pp_stage=stage),
        ]
    return out


def holds(layout: ParamLayout, mesh: RankMesh, rank: int) -> bool:
    return layout.pp_stage is None or mesh.coords(rank).pp_rank == layout.pp_stage


def full_tensor(layout: ParamLayout) -> torch.Tensor:
    """The parameter's full random tensor, the same in every process (seeded by its index in the name)."""
    seed = sum(ord(ch) * 31**i for i, ch in enumerate(layout.name)) % 2**31
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))


class BenchWorker(MegatronReshardWorker):
    """This rank's shards of ``layouts``: cut from the seeded full tensors on sources, zeros on destinations."""

    def __init__(self, layouts: list[ParamLayout], fill: bool) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.tensors = {}
        for p in layouts:
            if holds(p, self.mesh, self.rank):
                t = self.tensors[p.name] = torch.zeros(local_shape(p, self.mesh))
                if fill:
                    full = full_tensor(p)
                    for full_sl, local_sl in place(p, self.mesh, self.rank):
                        t[local_sl] = full[full_sl]

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @register(Dispatch.ALL_TO_ALL)
    def get_shards(self, wanted: bool) -> dict[str, np.ndarray] | None:
        """The naive way's gather: this rank's shards (only the ranks the controller reads)."""
        return {n: t.numpy() for n, t in self.tensors.items()} if wanted else None

    @register(Dispatch.ALL_TO_ALL)
    def set_shards(self, shards: dict[str, np.ndarray]) -> int:
        """The naive way's scatter: copy the slices the controller cut for this rank."""
        for name, array in shards.items():
            np.copyto(self.tensors[name].numpy(), array)  # one copy, from the read-only object-store view
        return sum(a.nbytes for a in shards.values())

    @register(Dispatch.ONE_TO_ALL)
    def checksum(self) -> dict[str, float]:
        return {n: float(t.double().sum()) + float(t.double().abs().sum()) for n, t in sorted(self.tensors.items())}

    @register(Dispatch.ONE_TO_ALL)
    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()


def place(layout: ParamLayout, mesh: RankMesh, rank: int) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(full slices, local slices) of each block of ``rank``'s shard."""
    c = mesh.coords(rank)
    tp_rank = c.etp_rank if layout.expert else c.tp_rank
    tp, ep = (mesh.size("etp"), mesh.size("ep")) if layout.expert else (mesh.size("tp"), 1)
    dims = shard_intervals(layout, tp, tp_rank, ep, c.ep_rank)
    out = []
    for combo in np.ndindex(*[len(d) for d in dims]):
        iv = [dims[k][i] for k, i in enumerate(combo)]
        out.append((tuple(slice(lo, hi) for lo, hi, _ in iv), tuple(slice(loc, loc + hi - lo) for lo, hi, loc in iv)))
    return out


def naive_refit(src_group, dst_group, layouts: list[ParamLayout], dst_layouts: list[ParamLayout], src: RankMesh,
                dst: RankMesh) -> dict[str, int]:
    """Gather full tensors on the controller from one dp replica, then send every destination its slices."""
    readers = [r for r in range(src.world_size) if src.coords(r).dp_rank == 0 and src.coords(r).cp_rank == 0]
    shards = src_group.get_shards([r in readers for r in range(src.world_size)])
    full = {p.name: np.empty(p.shape, dtype=np.float32) for p in layouts}
    gathered, per_src = 0, {}
    for r in readers:
        per_src[r] = sum(a.nbytes for a in shards[r].values())
        gathered += per_src[r]
        for p in layouts:
            if p.name in shards[r]:
                for full_sl, local_sl in place(p, src, r):
                    full[p.name][full_sl] = shards[r][p.name][local_sl]
    del shards
    jobs = []
    for r in range(dst.world_size):
        job = {}
        for p in dst_layouts:
            if holds(p, dst, r):
                blocks = place(p, dst, r)
                job[p.name] = np.concatenate([full[p.name][f] for f, _ in blocks], axis=p.tp_dim) if len(blocks) > 1 \
                    else np.ascontiguousarray(full[p.name][blocks[0][0]])
        jobs.append(job)
    sent = sum(dst_group.set_shards(jobs))
    return {"bytes": gathered + sent, "gathered": gathered, "sent": sent, "max_src": max(per_src.values())}


def parse_mesh(text: str) -> RankMesh:
    sizes: dict[str, Any] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        sizes[key.strip()] = value.strip() if key.strip() == "order" else int(value)
    return RankMesh(**sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default="tp=2,pp=2,dp=2", help="trainer mesh (default %(default)s)")
    parser.add_argument("--dst", action="append", help="generator mesh, repeatable (default tp=1,dp=8 and tp=4,dp=2)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each way; the median is printed")
    parser.add_argument("--transport", choices=("both", "auto", "store"), default="both",
                        help="reshard transport(s) timed beside naive: auto (direct reads on one node), store "
                             "(object store only), or both, alternated (default %(default)s)")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON")
    args = parser.parse_args(argv)
    import ray

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray

    transports = ["auto", "store"] if args.transport == "both" else [args.transport]
    src_mesh = parse_mesh(args.src)
    dst_meshes = [parse_mesh(d) for d in (args.dst or ["tp=1,dp=8", "tp=4,dp=2"])]
    layouts = gpt_layers(args.layers, args.hidden, args.ffn, src_mesh.size("pp"))
    model_bytes = sum(p.nbytes for p in layouts)
    procs = src_mesh.world_size + max(m.world_size for m in dst_meshes)
    ensure_ray(num_cpus=procs, object_store_memory=int(max(2 * 1024**3, 4 * model_bytes)))
    print(f"model: {args.layers} layers of hidden {args.hidden}, ffn {args.ffn}: {len(layouts)} tensors, "
          f"{model_bytes / MIB:.0f} MiB fp32; {os.cpu_count()} CPU cores, {procs} processes; "
          f"load average {os.getloadavg()[0]:.1f}")
    # Plan before any worker starts: the planner runs on the controller alone, and timing it while
    # 16 processes start up on a small machine measures the start-up, not the plan.
    plans = {}
    for dst_mesh in dst_meshes:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            plan = plan_reshard(layouts, src_mesh, dst_mesh)
            times.append(time.perf_counter() - t0)
        plans[dst_mesh] = plan, statistics.median(times)
    src_group = RayWorkerGroup(RayResourcePool([src_mesh.world_size], use_gpu=False),
                               RayClassWithInitArgs(BenchWorker, layouts, True), mesh=src_mesh)
    results = []
    try:
        for dst_mesh in dst_meshes:
            dst_layouts = [p.replace(pp_stage=None) for p in layouts]
            dst_group = RayWorkerGroup(RayResourcePool([dst_mesh.world_size], use_gpu=False),
                                       RayClassWithInitArgs(BenchWorker, dst_layouts, False), mesh=dst_mesh)
            try:
                plan, plan_s = plans[dst_mesh]
                minimum = sum(int(np.prod(local_shape(p, dst_mesh))) * p.itemsize
                              for p in dst_layouts for r in range(dst_mesh.world_size) if holds(p, dst_mesh, r))
                # The least the sources can put: each element of the model once (destinations keep all of it).
                distinct = model_bytes
                # Warm-ups (first object-store use of each process), and the weights each way leaves.
                sums = {}
                for transport in transports:
                    dst_group.zero()
                    reshard(src_group, dst_group, plan, transport=transport)
                    sums[transport] = dst_group.checksum()
                dst_group.zero()
                naive_refit(src_group, dst_group, layouts, dst_layouts, src_mesh, dst_mesh)
                # Alternate the ways run by run, so that a change in machine load hits all alike.
                ways = {t: (lambda t=t: reshard(src_group, dst_group, plan, transport=t)) for t in transports}
                ways["naive"] = lambda: naive_refit(src_group, dst_group, layouts, dst_layouts, src_mesh, dst_mesh)
                times: dict[str, list[float]] = {w: [] for w in ways}
                values: dict[str, list[Any]] = {w: [] for w in ways}
                for _ in range(args.repeat):
                    for way, fn in ways.items():
                        start = time.perf_counter()
                        values[way].append(fn())
                        times[way].append(time.perf_counter() - start)
                median = {w: statistics.median(ts) for w, ts in times.items()}
                naive, naive_time = values["naive"][0], median["naive"]
                same = all(v == dst_group.checksum() for v in sums.values())
                sent = plan.bytes_per_src_rank
                row = {
                    "src": repr(src_mesh), "dst": repr(dst_mesh), "plan_s": plan_s,
                    "bytes_plan": plan.bytes_moved, "bytes_naive": naive["bytes"], "bytes_minimum": minimum,
                    "time_naive_s": naive_time, "bytes_distinct": distinct,
                    "max_src_bytes_plan": max(sent.values()), "mean_src_bytes_plan": sum(sent.values()) / len(sent),
                    "max_src_bytes_naive": naive["max_src"], "regions": len(plan.transfers),
                    "identical_weights": same, "load_average": os.getloadavg()[0],
                }
                for transport in transports:
                    runs = values[transport]
                    row[transport] = {
                        "time_s": median[transport], "ratio_to_naive": median[transport] / naive_time,
                        "send_s": statistics.median(r.send_s for r in runs), "recv_s": statistics.median(r.recv_s for r in runs),
                        "copy_s": statistics.median(r.copy_s for r in runs), "bytes_put": runs[0].bytes_put,
                        "copy_cpu_s": statistics.median(r.copy_cpu_s for r in runs),
                        "bytes_direct": runs[0].bytes_direct, "objects": runs[0].objects, "refused": runs[0].refused,
                    }
                # The default transport's figures under the names earlier versions wrote.
                main_t = transports[0]
                row.update(time_reshard_s=median[main_t], speedup=naive_time / median[main_t], transport=main_t)
                results.append(row)
                print(f"\n{src_mesh!r} -> {dst_mesh!r}  ({len(plan.transfers)} regions, "
                      f"planned in {plan_s * 1000:.1f} ms, median of 3)")
                print(f"  bytes moved    reshard {plan.bytes_moved / MIB:9.1f} MiB   naive {naive['bytes'] / MIB:9.1f} MiB "
                      f"(gather {naive['gathered'] / MIB:.1f} + scatter {naive['sent'] / MIB:.1f})   minimum {minimum / MIB:9.1f} MiB"
                      f"   {'== minimum' if plan.bytes_moved == minimum else '!= MINIMUM'}")
                print(f"  time (median of {args.repeat}, ways alternated)   naive {naive_time:7.3f} s")
                for transport in transports:
                    r = row[transport]
                    label = {"auto": "reshard, direct (auto)", "store": "reshard, object store"}[transport]
                    print(f"    {label:24s} {r['time_s']:7.3f} s   ratio {r['ratio_to_naive']:.2f} (target <= 0.5)   "
                          f"send {r['send_s']:.3f} + rest of the receive {r['recv_s']:.3f} (slowest destination's copy "
                          f"{r['copy_s']:.3f}; all destinations' copying {r['copy_cpu_s']:.3f} CPU s)   read directly {r['bytes_direct'] / MIB:.1f} MiB, put {r['bytes_put'] / MIB:.1f} MiB "
                          f"in {r['objects']} objects" + (f", {r['refused']} pairs refused" if r["refused"] else ""))
                print(f"  max bytes by one source rank  reshard {max(sent.values()) / MIB:.1f} MiB "
                      f"(mean {sum(sent.values()) / len(sent) / MIB:.1f}, ratio {max(sent.values()) / (sum(sent.values()) / len(sent)):.3f})"
                      f"   naive {naive['max_src'] / MIB:.1f} MiB (to the controller, which then sends {naive['sent'] / MIB:.1f} MiB)")
                print(f"  destination weights identical after every way: {same}   (load average {os.getloadavg()[0]:.1f})")
            finally:
                dst_group.shutdown()
    finally:
        src_group.shutdown()
        ray.shutdown()
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    ok = all(r["identical_weights"] and r["bytes_plan"] == r["bytes_minimum"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
