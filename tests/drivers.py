"""Test drivers in their own process: one runner for the environment, the run and the ``REPORT`` line.

Why a second process at all: Ray allows one cluster connection per process, and the test session
already holds one (``ray_session`` in tests/conftest.py).  A scenario that needs another Ray (a
simulated multi-node cluster, a Ray the code under test must start itself, a user's own
``ray.init``) therefore runs in a driver process that prints one ``REPORT {json}`` line; the test
reads that line back and asserts on it.

Two ways to run one:

* :func:`run_module` / :func:`run_code` start a fresh process per scenario (``python -m module``
  or ``python -c code``) and return its report.  For scenarios that must own their Ray: those
  that remove nodes, or that check how Ray gets started or joined.
* :class:`SharedCluster` is ONE long-lived driver process holding ONE cluster of
  :data:`SHARED_NODES` for every test module whose scenarios leave the nodes alone: each node in
  its own network namespace with its own address (``rankmesh.testing.cluster``) where namespaces
  can be made, else raylets on 127.0.0.1 (:func:`shared_cluster_kind`).  A module
  asks it to call a function ``f(cluster, *args)`` by name and gets ``f``'s return value back.
  Starting raylets and a driver costs seconds each on a small machine, so the modules share them
  (the ``simulated_cluster`` fixture in tests/conftest.py; the modules are run back to back and the
  cluster is shut down after the last one).

Every driver gets the same environment (:func:`driver_env`): this checkout's ``src`` and root on
``PYTHONPATH`` (so ``tests.*`` modules import), Ray's loopback switch, no usage stats, and no
``RAY_ADDRESS`` inherited from the session (a driver must never join the session's Ray by accident).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
#: The line prefix a driver prints its one JSON report after.
REPORT = "REPORT "
#: The prefix :class:`SharedCluster`'s driver prints a scenario's traceback after.
FAILED = "FAILED "

#: Nodes of the shared simulated cluster (a CPU-less head plus these raylets on 127.0.0.1): two of
#: 4 CPUs and one of 2, each with a custom resource of its name and a ``zone`` label (a, a, b).
SHARED_NODES: dict[str, dict[str, Any]] = {
    name: {"num_cpus": cpus, "resources": {name: 1}, "labels": {"zone": zone}, "object_store_memory": 96 << 20}
    for name, cpus, zone in (("node_a", 4, "a"), ("node_b", 4, "a"), ("node_c", 2, "b"))
}


class DriverError(AssertionError):
    """A driver exited badly or printed no report; the message carries the tail of its output."""


def driver_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every test driver runs with (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def print_report(report: Any) -> None:
    """Driver side: print the one report line (JSON) that :func:`run_module` reads back."""
    print(REPORT + json.dumps(report), flush=True)


def read_report(stdout: str) -> Any | None:
    """The last report a driver printed, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(REPORT)]
    return json.loads(lines[-1][len(REPORT):]) if lines else None


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def run_module(module: str, *args: str, timeout: float, env: Mapping[str, str] | None = None) -> Any:
    """Run ``python -m module *args`` in the repository root; the report it printed.

    Raises :class:`DriverError` with the driver's output when it exits non-zero or prints no
    report, and lets ``subprocess.TimeoutExpired`` through after ``timeout`` seconds.
    """
    return _run([sys.executable, "-m", module, *args], module, timeout, env)


def run_code(code: str, *args: str, timeout: float, env: Mapping[str, str] | None = None) -> Any:
    """Run ``python -c code *args`` in the repository root; the report it printed (as :func:`run_module`)."""
    return _run([sys.executable, "-c", code, *args], "python -c", timeout, env)


def _run(argv: list[str], what: str, timeout: float, env: Mapping[str, str] | None) -> Any:
    proc = subprocess.run(argv, cwd=REPO, env=driver_env(env), capture_output=True, text=True, timeout=timeout)
    report = read_report(proc.stdout)
    if proc.returncode != 0 or report is None:
        raise DriverError(f"driver {what} failed: {_tail(proc)}")
    return report


# ----- one shared simulated cluster ------------------------------------------------------------


#: Where the shared cluster's nodes are when it is namespaced, by hand from the helper's host
#: numbers (.9 for the head, then .10, .100, .11 in :data:`SHARED_NODES` order): numerically
#: .10 < .11 < .100, as strings .10 < .100 < .11.
NETNS_ADDRESSES: dict[str, str] = {"head": "198.18.0.9", "node_a": "198.18.0.10", "node_b": "198.18.0.100",
                                   "node_c": "198.18.0.11"}
#: ``RANKMESH_TEST_CLUSTER``: ``netns`` or ``loopback`` forces the shared cluster's kind; unset or
#: ``auto``, it is namespaced wherever namespaces can be made.
CLUSTER_KIND_ENV = "RANKMESH_TEST_CLUSTER"


def shared_cluster_kind() -> str:
    """``"netns"`` (a namespace per node) where namespaces can be made, else ``"loopback"``; the
    reason is logged once when it falls back."""
    wanted = os.environ.get(CLUSTER_KIND_ENV, "auto")
    if wanted not in ("auto", "netns", "loopback"):
        raise ValueError(f"{CLUSTER_KIND_ENV}={wanted!r}: expected auto, netns or loopback")
    if wanted == "loopback":
        return "loopback"
    from rankmesh.testing.cluster import unavailable

    reason = unavailable()
    if reason is None:
        return "netns"
    if wanted == "netns":
        raise DriverError(f"{CLUSTER_KIND_ENV}=netns, but no namespaced cluster can be made here: {reason}")
    logging.getLogger(__name__).warning("the shared multi-node cluster runs on loopback: %s", reason)
    return "loopback"


def resolve(name: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


class SharedCluster:
    """Controller side of the one shared simulated cluster: a driver process that runs scenarios on request.

    Protocol (one line each way per scenario): the test writes ``{"fn": "module:function",
    "args": [...]}``; the driver calls ``function(cluster, *args)`` and prints ``REPORT {json}``
    with the return value, or ``FAILED {json traceback}``.  Closing stdin shuts the cluster down.
    Scenarios must leave the cluster as they found it (shut groups down, remove pools) and must
    not remove nodes: later modules use the same nodes.
    """

    def __init__(self, start_timeout: float = 180.0, kind: str | None = None) -> None:
        self.start_timeout = start_timeout
        #: ``"netns"`` or ``"loopback"`` (:func:`shared_cluster_kind`).
        self.kind = kind or shared_cluster_kind()
        self._netns: Any = None  # the namespaced cluster, while it runs
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr: list[str] = []
        #: Node ids of the running cluster (None until the first :meth:`run` starts it).
        self.nodes: list[str] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        """Start the driver and wait for its cluster (the driver reports the node ids once it is up)."""
        self._stderr = []
        pipes = {"text": True, "stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        if self.kind == "netns":
            from rankmesh.testing.cluster import NetnsCluster

            self._netns = NetnsCluster(nodes=list(SHARED_NODES.values()), lifetime_s=3 * 3600).start()
            # The driver joins from the head's namespace; the cluster's own environment, plus this checkout.
            self._proc = self._netns.popen([sys.executable, "-m", "tests.drivers", "join"], cwd=REPO,
                                           env={"PYTHONPATH": driver_env()["PYTHONPATH"]}, **pipes)
        else:
            self._proc = subprocess.Popen([sys.executable, "-m", "tests.drivers"], cwd=REPO, env=driver_env(), **pipes)
        # stderr is drained by a thread (Ray logs there; a full pipe would block the driver).
        threading.Thread(target=self._drain, args=(self._proc,), daemon=True).start()
        self.nodes = self._answer(self.start_timeout)

    def _drain(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def _answer(self, timeout: float) -> Any:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        result: list[str] = []

        def read() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith((REPORT, FAILED)):
                    result.append(line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            state = "timed out" if reader.is_alive() else f"exited {proc.poll()}"
            self.close()
            raise DriverError(f"shared cluster driver {state} after {timeout:g} s:\n{''.join(self._stderr)[-4000:]}")
        line = result[0]
        if line.startswith(FAILED):
            raise DriverError("scenario failed in the shared cluster driver:\n" + json.loads(line[len(FAILED):]))
        return json.loads(line[len(REPORT):])

    def run(self, fn: str, *args: Any, timeout: float = 240.0) -> Any:
        """Call ``fn(cluster, *args)`` in the driver (``fn`` as ``"module:function"``); its JSON result.

        The first call starts the driver and its cluster; so does the first call after :meth:`close`.
        """
        with self._lock:
            if not self.running:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write(json.dumps({"fn": fn, "args": list(args)}) + "\n")
            self._proc.stdin.flush()
            return self._answer(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Shut the cluster down (the driver does on end of input) and wait for the process."""
        proc, self._proc = self._proc, None
        netns, self._netns = self._netns, None
        try:
            self._stop(proc, timeout)
        finally:
            if netns is not None:
                netns.close()

    @staticmethod
    def _stop(proc: subprocess.Popen | None, timeout: float) -> None:
        if proc is None:
            return
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:  # a scenario hangs: SIGTERM still shuts the cluster down
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def serve(nodes: Sequence[Mapping[str, Any]] = tuple(SHARED_NODES.values()), join: bool = False) -> None:
    """Driver side of :class:`SharedCluster`: build the cluster (or, with ``join``, join the
    namespaced one through ``RAY_ADDRESS`` from the head's namespace), answer scenario requests
    until end of input.  Scenarios get the simulated cluster's handle, or ``None`` when joined."""
    import ray

    from rankmesh.backends.ray.simulated import loopback_cluster
    from rankmesh.testing.cluster import ADDRESS_ENV

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below: no stray raylets
    if join:
        cluster = None
        ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[ADDRESS_ENV], logging_level="ERROR")
    else:
        cluster, _ = loopback_cluster(nodes)
    try:
        print_report(sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]))
        for line in sys.stdin:
            request = json.loads(line)
            try:
                out = resolve(request["fn"])(cluster, *request["args"])
                encoded = json.dumps(out)
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                print(FAILED + json.dumps(traceback.format_exc()), flush=True)
                continue
            print(REPORT + encoded, flush=True)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    serve(join=sys.argv[1:] == ["join"])
