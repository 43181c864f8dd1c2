#!/usr/bin/env python
"""Check, on a GPU machine, that ranks forked from a warm process use CUDA as spawned ranks do.

Why a script and not a test: CI has no GPU.  The CPU suite checks a forked rank's environment,
random state and children against a spawned rank's (``tests/test_forked_ranks.py``); what only a
GPU shows is that the warm process never started CUDA (a fork of a process with a CUDA context
cannot use CUDA: torch calls that a "bad fork"), that each forked rank gets its bundle's
``CUDA_VISIBLE_DEVICES`` and starts its own context, and what forking saves there.

What it does (one local Ray on 127.0.0.1):

1. One rank on a ``use_gpu=True`` bundle, forked (``process_model="fork"``) and spawned
   (``"ray"``): both report ``CUDA_VISIBLE_DEVICES``, what torch sees and a matrix product on
   the device, checked against the same product on the CPU.  They must agree.
2. Four forked ranks on bundles without a GPU (Ray leaves their visible devices alone, so each
   uses the machine's first GPU): each starts its own CUDA context, none is in a bad fork, and
   their CUDA generators start as two spawned ranks' do (alike, or each its own).
3. The node's warm processes (from their keeper): none has the CUDA driver library mapped or
   appears among ``nvidia-smi``'s compute processes, where every rank that used the GPU does.
4. Start-up wall time of the one-rank group, forked then spawned, and of the four-rank group.

Exit status 0 when every check holds.

    python scripts/check_gpu_fork.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.forked import KEEPER_NAME  # noqa: E402
from rankmesh.backends.ray.runtime import DETACHED_NAMESPACE, ensure_ray  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402


class GpuProbe(Worker):
    """What CUDA looks like from inside a rank."""

    @register(Dispatch.ONE_TO_ALL)
    def probe(self) -> dict:
        import torch

        bad_fork = torch.cuda._is_in_bad_fork()
        available = torch.cuda.is_available()
        out = {"pid": os.getpid(), "ppid": os.getppid(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "bad_fork": bad_fork, "available": available}
        if available:
            g = torch.Generator().manual_seed(1234)  # its own generator: the process's stay as they were
            a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
            on_gpu = (a.cuda() @ b.cuda()).cpu()
            out.update(count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
                       max_error=float((on_gpu - a @ b).abs().max()))
        return out

    @register(Dispatch.ONE_TO_ALL)
    def cuda_draw(self) -> float | None:
        """The first number of the CUDA generator as the process left it (nothing seeded it)."""
        import torch

        return float(torch.rand(1, device="cuda")[0]) if torch.cuda.is_available() else None


def warm_pids() -> list[int]:
    keeper = ray.get_actor(KEEPER_NAME.format(node_id=ray.get_runtime_context().get_node_id()), namespace=DETACHED_NAMESPACE)
    return [pid for _, pid in ray.get(keeper.processes.remote())]


def cuda_processes() -> set[int]:
    if not shutil.which("nvidia-smi"):
        return set()
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True)
    return {int(line) for line in out.stdout.split() if line.strip().isdigit()}


def maps_driver(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libcuda.so" in f.read()


def main() -> int:
    import torch

    gpu = torch.cuda.is_available()  # without one the script runs, and its CUDA checks fail
    ensure_ray(num_cpus=8)
    checks: dict[str, bool] = {}
    report: dict[str, object] = {}
    one = {}
    for model in ("fork", "ray"):
        start = time.perf_counter()
        wg = RayWorkerGroup(RayResourcePool([1], use_gpu=gpu), RayClassWithInitArgs(GpuProbe), process_model=model)
        report[f"one_rank_start_s_{model}"] = round(time.perf_counter() - start, 2)
        draw = wg.cuda_draw()[0]  # first: nothing else touched the generator yet
        one[model] = {**wg.probe()[0], "cuda_draw": draw}
        report[f"one_rank_{model}"] = one[model]
        if model == "fork":
            four_start = time.perf_counter()
            four = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(GpuProbe), process_model="fork")
            report["four_ranks_start_s_fork"] = round(time.perf_counter() - four_start, 2)
            draws = four.cuda_draw()
            got = [{**g, "cuda_draw": d} for g, d in zip(four.probe(), draws)]
            report["four_ranks_fork"] = got
            warm = warm_pids()
            users = cuda_processes()
            report.update(warm_pids=warm, cuda_processes=sorted(users))
            checks["no warm process mapped the CUDA driver"] = bool(warm) and not any(maps_driver(p) for p in warm)
            checks["no warm process is a CUDA process"] = not set(warm) & users
            checks["every forked rank is a CUDA process"] = {g["pid"] for g in got} | {one[model]["pid"]} <= users
            checks["four forked ranks: CUDA, no bad fork, products right"] = all(
                g["available"] and not g["bad_fork"] and g.get("max_error", 1.0) < 1e-2 for g in got)
            checks["forked ranks are children of a warm process"] = {g["ppid"] for g in got} <= set(warm)
            four.shutdown()
        wg.shutdown()
    f, r = one["fork"], one["ray"]
    checks["one rank: forked sees what spawned sees"] = (f["cvd"], f["available"], f.get("count"), f.get("name")) == (
        r["cvd"], r["available"], r.get("count"), r.get("name")) and f["available"]
    checks["one rank: forked product right, no bad fork"] = f.get("max_error", 1.0) < 1e-2 and not f["bad_fork"]
    # CUDA's generators are seeded in the rank when CUDA starts: forked ranks draw alike exactly
    # when spawned ones do (two spawned ranks on bundles without a GPU say which).
    two = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(GpuProbe), process_model="ray")
    spawned_draws = two.cuda_draw()
    two.shutdown()
    forked_draws = [g["cuda_draw"] for g in report["four_ranks_fork"]]
    report.update(spawned_cuda_draws=spawned_draws, forked_cuda_draws=forked_draws)
    alike = len(set(spawned_draws)) == 1
    checks["forked ranks' CUDA generators start as spawned ranks' do"] = None not in spawned_draws and (
        set(forked_draws) == set(spawned_draws) if alike else len(set(forked_draws)) == len(forked_draws))
    print(json.dumps(report, indent=1, default=str))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
