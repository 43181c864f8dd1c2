#!/usr/bin/env python
"""Launch a group of MegatronWorkers and check, rank by rank, that megatron agrees with rankmesh.

For every rank it prints the controller's coordinates (from the RankMesh) beside the ones
megatron-core's ``parallel_state`` reports, the members of each process group both ways, and the
result of an all-reduce of the global rank ids over each group (tp, pp, cp, dp, dp-cp, ep)
against the sum the controller expects.  It ends with one verdict line and exits 1 on any
mismatch (0 when everything agrees, 2 on bad usage).

    python scripts/validate_rank_mapping.py --layout cpu_demo --role actor
    python scripts/validate_rank_mapping.py --tp 2 --cp 2 --dp 2 --json
    python scripts/validate_rank_mapping.py --layout my.yaml --address ray://head:10001

Without ``--address`` it starts a local Ray bound to 127.0.0.1 (or reuses this process's Ray).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from rankmesh.errors import RankMeshError
from rankmesh.megatron.check import GROUPS, Mismatch, RankReport, compare_reports, expected_report
from rankmesh.mesh import AXES, DEFAULT_ORDER, RankMesh

log = logging.getLogger("rankmesh.validate")

SHOWN_GROUPS = ("tp", "pp", "cp", "dp", "dp-cp", "ep")
#: What to check: (label, mesh, process counts per node).
Target = tuple[str, RankMesh, list[int]]


@dataclass
class Validation:
    """The outcome of one run: the mesh, every worker's report, every mismatch."""

    mesh: RankMesh
    source: str
    reports: list[RankReport]
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def verdict(self) -> str:
        n = self.mesh.world_size
        if self.ok:
            return (f"VERDICT: PASS - all {n} ranks agree with {self.mesh!r}: coordinates, members of "
                    f"{len(GROUPS)} group kinds and their all-reduces ({self.seconds:.1f}s)")
        bad = sorted({m.rank for m in self.mismatches})
        kinds = sorted({m.what for m in self.mismatches})
        return (f"VERDICT: FAIL - {len(bad)} of {n} ranks disagree with {self.mesh!r} "
                f"(ranks {bad}; {', '.join(kinds[:8])}{' ...' if len(kinds) > 8 else ''})")

    def to_json(self) -> dict[str, Any]:
        by_rank: dict[int, list[dict]] = {}
        for m in self.mismatches:
            by_rank.setdefault(m.rank, []).append({"what": m.what, "expected": m.expected, "actual": m.actual})
        return {
            "source": self.source,
            "mesh": {**self.mesh.sizes, "order": self.mesh.order, "world_size": self.mesh.world_size},
            "ok": self.ok,
            "verdict": self.verdict(),
            "seconds": round(self.seconds, 3),
            "ranks": [
                {
                    "rank": r.rank,
                    "controller": expected_report(self.mesh, r.rank).to_dict() if r.rank < self.mesh.world_size else None,
                    "parallel_state": r.to_dict(),
                    "mismatches": by_rank.get(r.rank, []),
                }
                for r in sorted(self.reports, key=lambda r: r.rank)
            ],
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", metavar="NAME_OR_FILE", help="a layout name (see `rankmesh layout list`) or YAML file")
    p.add_argument("--role", help="the layout's role to check (default: every role with a distinct mesh)")
    for axis in ("tp", "pp", "cp", "ep", "etp", "dp"):
        p.add_argument(f"--{axis}", type=int, metavar="N")
    p.add_argument("--order", help=f"megatron order string, fastest axis first (default {DEFAULT_ORDER})")
    p.add_argument("--address", help="Ray cluster address (default: local Ray on 127.0.0.1)")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of the tables")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the group to start")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per rank (nccl); default CPU + gloo")
    p.add_argument("--force-order", help=argparse.SUPPRESS)  # testing: build parallel_state with another order
    return p


def resolve_meshes(args: argparse.Namespace) -> list[Target]:
    """(label, mesh, process counts per node) for each mesh to check."""
    explicit = any(getattr(args, a) is not None for a in ("tp", "pp", "cp", "ep", "etp", "dp", "order"))
    if args.layout and explicit:
        raise RankMeshError("give either --layout or explicit sizes (--tp/--pp/...), not both")
    if args.layout:
        from rankmesh.layout import load_layout

        layout = load_layout(args.layout)
        roles = [layout.role(args.role)] if args.role else list(layout.roles.values())
        out, seen = [], set()
        for role in roles:
            mesh = role.mesh()
            key = (mesh, tuple(role.pool.process_on_nodes))
            if key in seen:  # colocated roles share a mesh: one check covers them
                continue
            seen.add(key)
            out.append((f"layout {layout.name} role {role.name}", mesh, list(role.pool.process_on_nodes)))
        return out
    if args.role:
        raise RankMeshError("--role needs --layout")
    if not explicit:
        raise RankMeshError("give --layout NAME_OR_FILE or explicit sizes such as --tp 2 --pp 2 --dp 2")
    mesh = RankMesh(
        tp=args.tp or 1, pp=args.pp or 1, cp=args.cp or 1, dp=args.dp or 1, ep=args.ep or 1,
        etp=args.etp, order=args.order or DEFAULT_ORDER,
    )
    return [("explicit sizes", mesh, [mesh.world_size])]


def validate_all(targets: Sequence[Target], *, use_gpu: bool = False, timeout: float = 300.0,
                 force_order: str | None = None, processes: Any = None) -> list[Validation]:
    """Check every ``(label, mesh, process counts per node)`` target on the connected Ray, in order.

    Targets with the same process counts share ONE group of processes: the first one's mesh starts
    the group, the others are checked on those processes with parallel_state rebuilt for each
    (``MegatronWorker.megatron_report(mesh=...)``).  Each process costs ~2-4 s to start (it imports
    torch and megatron-core), so a layout's critic and rollout of 4 ranks each take 4 processes,
    not 8.  ``processes``: where the groups run (``start``/``stop``; default a new pool per group,
    :class:`~rankmesh.backends.ray.group.PoolPerGroup`).
    """
    from rankmesh.backends.ray import PoolPerGroup

    processes = processes if processes is not None else PoolPerGroup(use_gpu=use_gpu, start_timeout=timeout)
    shapes: dict[tuple[int, ...], list[int]] = {}
    for index, (_, _, counts) in enumerate(targets):
        shapes.setdefault(tuple(counts), []).append(index)
    results: dict[int, Validation] = {}
    for counts, indices in shapes.items():
        started = time.perf_counter()
        group = start_group(targets[indices[0]][1], counts, processes, force_order=force_order)
        try:
            for index in indices:
                label, mesh, _ = targets[index]
                results[index] = validate_on(group, mesh, source=label, started=started)
                started = time.perf_counter()
            group.destroy_megatron()
        finally:
            processes.stop(group)
    return [results[index] for index in range(len(targets))]


def start_group(mesh: RankMesh, process_on_nodes: Sequence[int], processes: Any, *, force_order: str | None = None) -> Any:
    """A RayWorkerGroup of MegatronWorkers over ``mesh`` from ``processes`` (parallel_state built, nothing checked yet)."""
    from rankmesh.backends.ray import RayClassWithInitArgs
    from rankmesh.megatron.worker import MegatronWorker

    kwargs = {"force_order": force_order} if force_order else {}
    return processes.start(list(process_on_nodes), RayClassWithInitArgs(MegatronWorker, **kwargs), mesh)


def validate_on(group: Any, mesh: RankMesh, *, source: str = "", started: float | None = None) -> Validation:
    """Check ``mesh`` on a running group of MegatronWorkers: its own mesh, or another over the same ranks."""
    from rankmesh.megatron.group import collect_reports

    started = time.perf_counter() if started is None else started
    reports = collect_reports(group, allreduce=True, mesh=mesh)
    result = Validation(mesh, source, reports, compare_reports(mesh, reports))
    result.seconds = time.perf_counter() - started
    return result


def validate(mesh: RankMesh, process_on_nodes: Sequence[int] | None = None, *, source: str = "",
             use_gpu: bool = False, timeout: float = 300.0, force_order: str | None = None) -> Validation:
    """Start MegatronWorkers over ``mesh`` on the connected Ray, collect reports, compare, shut down."""
    target = (source, mesh, list(process_on_nodes or [mesh.world_size]))
    return validate_all([target], use_gpu=use_gpu, timeout=timeout, force_order=force_order)[0]


def report_document(results: Sequence[Validation]) -> dict[str, Any]:
    """The ``--json`` document: the overall verdict and every mesh's report."""
    return {"ok": all(r.ok for r in results), "results": [r.to_json() for r in results]}


def _cell(values: dict[str, int]) -> str:
    return " ".join(f"{values.get(a, '?'):>2}" for a in AXES)


def format_validation(v: Validation) -> str:
    """The human-readable tables of one run (without the verdict line)."""
    mesh = v.mesh
    lines = [f"{v.source}: {mesh!r}, {mesh.world_size} ranks", ""]
    axes = " ".join(f"{a:>2}" for a in AXES)
    lines.append(f"rank | controller {axes} | parallel_state {axes} | host:pid")
    bad_ranks = {m.rank for m in v.mismatches}
    for r in sorted(v.reports, key=lambda r: r.rank):
        want = expected_report(mesh, r.rank).coords if r.rank < mesh.world_size else {}
        flag = "MISMATCH" if r.rank in bad_ranks else "ok"
        lines.append(f"{r.rank:>4} | {'':>10} {_cell(want)} | {'':>14} {_cell(r.coords)} | {r.hostname}:{r.pid}  {flag}")
    shown = [g for g in SHOWN_GROUPS] + (["etp", "edp"] if mesh.size("ep") > 1 else [])
    lines += ["", "groups: controller members | parallel_state members | all-reduce of rank ids (got / expected)"]
    for r in sorted(v.reports, key=lambda r: r.rank):
        if r.rank >= mesh.world_size:
            continue
        want = expected_report(mesh, r.rank)
        lines.append(f"  rank {r.rank}")
        for g in shown:
            got_sum, exp_sum = r.allreduce.get(g, "?"), want.allreduce[g]
            same = want.groups[g] == r.groups.get(g) and got_sum == exp_sum
            lines.append(
                f"    {g:<6} {str(want.groups[g]):<16} | {str(r.groups.get(g)):<16} | "
                f"{got_sum} / {exp_sum}  {'ok' if same else 'MISMATCH'}"
            )
    if v.mismatches:
        lines += ["", "mismatches:"] + [f"  {m}" for m in v.mismatches[:50]]
        if len(v.mismatches) > 50:
            lines.append(f"  ... and {len(v.mismatches) - 50} more")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, processes: Any = None) -> int:
    """Run the validation; the exit code is the verdict (0 pass, 1 mismatch, 2 usage error).

    ``processes``: where the groups run (see :func:`validate_all`; the tests lend running ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    try:
        targets = resolve_meshes(args)
    except RankMeshError as exc:
        print(f"validate_rank_mapping: error: {exc}", file=sys.stderr)
        return 2
    from rankmesh.backends.ray.runtime import ensure_ray

    needed = max(sum(counts) for _, _, counts in targets)
    conn = ensure_ray(args.address, num_cpus=max(needed, os.cpu_count() or 1))
    try:
        results = validate_all(targets, use_gpu=args.use_gpu, timeout=args.timeout, force_order=args.force_order,
                               processes=processes)
    finally:
        if conn.started_here:
            import ray

            ray.shutdown()
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps(report_document(results), indent=2, default=str))
    else:
        for r in results:
            print(format_validation(r))
            print(r.verdict())
            print()
        if len(results) > 1:
            print(f"VERDICT: {'PASS' if ok else 'FAIL'} - {sum(r.ok for r in results)} of {len(results)} meshes agree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
