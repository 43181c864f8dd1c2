"""Worker classes and a fork harness for the megatron tests.

The worker classes live in an importable module (not in a test file) so that Ray worker
processes can unpickle them.  :func:`run_forked` runs a function on every rank of a local
torch.distributed group made of forked processes: megatron-core is imported once in the parent,
so a group starts in about a second instead of paying the ~3 s import per process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from typing import Any, Callable

from megatron.core.parallel_state import RankGenerator

from rankmesh.megatron.check import RankReport
from rankmesh.megatron.worker import MegatronWorker
from rankmesh.mesh import RankMesh


class ReportWorker(MegatronWorker):
    """A bare MegatronWorker (reports only)."""




def _child(fn: Callable[[int, int], Any], rank: int, world: int, port: int, conn) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        result = ("ok", fn(rank, world))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(result))
    conn.close()
    os._exit(0)


def run_forked(fn: Callable[[int, int], Any], world: int, timeout: float = 120.0) -> list[Any]:
    """``[fn(rank, world) for each rank]``, each in its own forked process of one gloo world."""
    import sys

    from rankmesh.rendezvous import release_port, reserve_port

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        raise RuntimeError(
            "run_forked after ray.init: forking a connected Ray driver corrupts its gRPC channels "
            "(later Ray calls hang); run forking tests before the session's Ray starts (tests/conftest.py)"
        )
    port = reserve_port("127.0.0.1")  # inherited by rank 0, which hands it to the TCPStore
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    try:
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(fn, rank, world, port, send), daemon=True)
            proc.start()
            send.close()
            pipes.append(recv)
            procs.append(proc)
    finally:
        release_port("127.0.0.1", port)
    results: list[Any] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    for rank, (recv, proc) in enumerate(zip(pipes, procs)):
        try:
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                errors.append(f"rank {rank}: no result within {timeout}s")
                continue
            status, value = pickle.loads(recv.recv_bytes())
        except EOFError:
            errors.append(f"rank {rank}: process died (exit code {proc.exitcode})")
            continue
        (results if status == "ok" else errors).append(value if status == "ok" else f"rank {rank}:\n{value}")
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def construct_worker(cls: type, mesh: RankMesh, rank: int, *args: Any, **kwargs: Any) -> Any:
    """Build ``cls`` as rank ``rank`` of a group over ``mesh`` (what a backend does)."""
    from rankmesh.worker import WorkerContext, construct

    ctx = WorkerContext(rank=rank, world_size=mesh.world_size, mesh=mesh)
    return construct(cls, ctx, args, kwargs)


def oracle_reports(mesh: RankMesh, order: str | None = None) -> list[RankReport]:
    """What correct workers would report, computed by megatron's own RankGenerator only."""
    order = order or mesh.order
    s = mesh.sizes
    dense = RankGenerator(tp=s["tp"], ep=1, dp=s["dp"], pp=s["pp"], cp=s["cp"], order=order)
    expert = RankGenerator(tp=s["etp"], ep=s["ep"], dp=s["edp"], pp=s["pp"], cp=1, order=order)
    tokens = {"tp": (dense, "tp"), "pp": (dense, "pp"), "cp": (dense, "cp"), "dp": (dense, "dp"),
              "dp-cp": (dense, "dp-cp"), "ep": (expert, "ep"), "etp": (expert, "tp"), "edp": (expert, "dp")}
    reports = []
    for rank in range(mesh.world_size):
        groups = {}
        for name, (gen, token) in tokens.items():
            groups[name] = next(g for g in gen.get_ranks(token) if rank in g)
        coords = {axis: groups[name].index(rank) for axis, name in
                  (("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("dp", "dp"), ("ep", "ep"), ("etp", "etp"), ("edp", "edp"))}
        reports.append(RankReport(rank=rank, world_size=mesh.world_size, coords=coords, sizes=dict(
            tp=s["tp"], pp=s["pp"], cp=s["cp"], dp=s["dp"], ep=s["ep"], etp=s["etp"], edp=s["edp"]),
            groups=groups, allreduce={k: sum(v) for k, v in groups.items()}))
    return reports
