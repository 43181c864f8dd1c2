"""Losing and adding nodes from inside a test driver: raylets on 127.0.0.1 the driver owns, or a namespaced cluster its test owns.

Why two: a scenario that removes nodes owns its cluster.  On loopback the driver starts the
raylets itself (``rankmesh.backends.ray.simulated.loopback_cluster``) and removes them.  A
namespaced cluster (``rankmesh.testing.cluster``) is made and changed by the test process, in
the host's namespace, while the driver runs inside it: the driver asks for each change with a
cue line on stdout (``NODES kill ADDRESS`` or ``NODES add {spec}``) and waits for the test's
answer on stdin (``done ADDRESS``), which :func:`serve_cues` gives.  A scenario sees one
interface either way (:class:`LoopbackNodes`, :class:`CuedNodes`), chosen by :func:`nodes_for`.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any, Mapping, Sequence

#: The variable a test sets for its driver: the namespaced cluster's worker node addresses, in
#: the order of the specs it was made with (JSON); unset on loopback.
NODES_ENV = "RANKMESH_TEST_NODES"
#: The prefix of a driver's request to its test.
CUE = "NODES "
#: How long a driver waits for its test to answer a cue (seconds): starting a node's raylet on a
#: loaded 2-core machine takes up to a minute.
ASK_S = 300.0


class LoopbackNodes:
    """Raylets on 127.0.0.1 (plus a CPU-less head) that this driver started and changes itself."""

    def __init__(self, specs: Sequence[Mapping[str, Any]], health: Mapping[str, int]) -> None:
        from rankmesh.backends.ray.simulated import loopback_cluster

        self.cluster, handles = loopback_cluster(specs, head_args={"_system_config": dict(health)}, logging_level="ERROR")
        self._handles = {h.node_id: h for h in handles}
        #: Worker node ids, in the order of ``specs``.
        self.ids = [h.node_id for h in handles]

    def kill(self, node_id: str) -> None:
        """The node and its processes go at once, as a machine that lost power."""
        self.cluster.remove_node(self._handles.pop(node_id), allow_graceful=False)

    def add(self, spec: Mapping[str, Any]) -> str:
        from rankmesh.backends.ray.simulated import LOOPBACK

        handle = self.cluster.add_node(**dict(spec), node_ip_address=LOOPBACK)
        self.cluster.wait_for_nodes()
        self._handles[handle.node_id] = handle
        return handle.node_id

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


class CuedNodes:
    """A namespaced cluster its test owns: this driver joins it and asks the test for changes."""

    def __init__(self, addresses: Sequence[str]) -> None:
        import ray

        from rankmesh.testing.cluster import ADDRESS_ENV

        ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[ADDRESS_ENV], logging_level="ERROR")
        self.ids = [self._id_of(address) for address in addresses]

    @staticmethod
    def _id_of(address: str, timeout: float = 60.0) -> str:
        import ray

        end = time.monotonic() + timeout
        while True:
            found = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address]
            if found:
                return found[0]
            if time.monotonic() > end:
                raise TimeoutError(f"no live node at {address} within {timeout:g} s")
            time.sleep(0.2)

    def _ask(self, what: str, timeout: float = ASK_S) -> str:
        print(CUE + what, flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the test did not answer {what!r} within {timeout:g} s")
        line = sys.stdin.readline().strip()
        if not line.startswith("done "):
            raise SystemExit(f"expected 'done ADDRESS' from the test after {what!r}, got {line!r}")
        return line.split(" ", 1)[1]

    def kill(self, node_id: str) -> None:
        """Every process of the node's namespace SIGKILLed and the namespace removed (the test's ``kill_node``)."""
        import ray

        address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        self._ask(f"kill {address}")

    def add(self, spec: Mapping[str, Any]) -> str:
        return self._id_of(self._ask("add " + json.dumps(dict(spec))))

    def close(self) -> None:
        import ray

        ray.shutdown()


def nodes_for(specs: Sequence[Mapping[str, Any]], health: Mapping[str, int]) -> LoopbackNodes | CuedNodes:
    """The driver's nodes: the namespaced cluster its test made (``NODES_ENV`` set), else loopback raylets."""
    addresses = os.environ.get(NODES_ENV)
    return CuedNodes(json.loads(addresses)) if addresses else LoopbackNodes(specs, health)


def serve_cues(cluster: Any, proc: Any, timeout: float) -> str:
    """Test side: answer the driver's cues on ``cluster`` (a started NetnsCluster) until it prints
    its ``REPORT`` line, which is returned.  Bounded by ``timeout`` seconds in all."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line.startswith("REPORT "):
            return line
        if line == "" and proc.poll() is not None:
            break
        if line.startswith(CUE):
            verb, _, arg = line[len(CUE):].partition(" ")
            node = cluster.kill_node(arg) if verb == "kill" else cluster.add_node(json.loads(arg))
            proc.stdin.write(f"done {node.address}\n")
            proc.stdin.flush()
    raise TimeoutError(f"no REPORT from the driver within {timeout:g} s (exit {proc.poll()})")


def run_node_scenario(module: str, specs: Sequence[Mapping[str, Any]], health: Mapping[str, int],
                      timeout: float) -> tuple[Any, str]:
    """Test side: run ``python -m module`` (a driver that takes its nodes from :func:`nodes_for`)
    on a namespaced cluster of ``specs`` made here, where namespaces can be made, else as a
    plain driver that starts loopback raylets; its report, and the kind of cluster it ran on."""
    import subprocess

    from tests.drivers import REPO, REPORT, driver_env, run_module, shared_cluster_kind

    kind = shared_cluster_kind()
    if kind != "netns":
        return run_module(module, timeout=timeout), kind
    from rankmesh.testing.cluster import NetnsCluster

    with NetnsCluster(nodes=specs, health=health, lifetime_s=timeout + 120) as cluster:
        env = {"PYTHONPATH": driver_env()["PYTHONPATH"], NODES_ENV: json.dumps([n.address for n in cluster.nodes[1:]])}
        proc = cluster.popen([sys.executable, "-m", module], cwd=REPO, env=env, text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            line = serve_cues(cluster, proc, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    return json.loads(line[len(REPORT):]), kind
