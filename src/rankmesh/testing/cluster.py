"""A Ray cluster of real network stacks on one machine: one network namespace per node, for tests and scripts.

Why: the simulated clusters (:mod:`rankmesh.backends.ray.simulated`) run every raylet in one
network stack, so they cannot produce the faults multi-node users meet: a node cut off while its
processes live on, a slow link, node addresses whose string order differs from their numeric
order.  Firewall rules inside one namespace do not help either, because Ray's connections do not
bind their node's address.  Here every node is its own network namespace:

* a **core** namespace ``rmnet-<pid>-<tag>-core`` holds one bridge; nothing links it to the
  host's namespace, so no packet of the cluster can leave it (and nothing outside can reach it);
* every node is a namespace ``rmnet-<pid>-<tag>-n<i>`` with ``lo`` and one veth ``eth0``, whose
  peer ``p-n<i>`` sits in the core namespace on the bridge;
* addresses come from :data:`DEFAULT_NETWORK` (198.18.0.0/15 is reserved for benchmarking,
  RFC 2544), hosts in the order of :data:`HOST_NUMBERS`: ``.9``, ``.10``, ``.100`` first, so
  that string order (.10 < .100 < .9) is not numeric order.  :func:`check_network` refuses a
  range the host's namespace has an address or a route in (the default route aside: no node
  namespace has a way to it);
* every node runs ``ray start`` inside its namespace with its own ``--temp-dir`` (Unix sockets
  live on the shared filesystem, so two nodes in one temp dir would clash), and the processes
  Ray starts inherit the namespace.

Faults are changes to the links, never to Ray: :meth:`NetnsCluster.partition` sets the node's
bridge port down (its processes live on and TCP to it times out) and :meth:`~NetnsCluster.heal`
sets it up again; :meth:`~NetnsCluster.cap` puts a token-bucket filter (``tc tbf``) on both ends
of the node's link; :meth:`~NetnsCluster.kill_node` kills every process in the node's namespace
(``ray stop`` would kill every Ray on the machine); :meth:`~NetnsCluster.add_node` starts one more.

Health checks (:data:`TEST_HEALTH_CHECKS`, passed as the head's ``--system-config``) are tightened
so that the GCS declares a lost node dead within a few seconds; Ray's defaults
(:data:`RAY_DEFAULT_HEALTH_CHECKS`, ``src/ray/common/ray_config_def.h``) take up to about a minute.

Access: the cluster is reachable only from inside its namespaces, so a driver runs there too
(:meth:`NetnsCluster.run`, :meth:`~NetnsCluster.popen`: ``ip netns exec`` in the head's namespace
by default) with :meth:`~NetnsCluster.env` (``RAY_ADDRESS`` set, token authentication off: no
process outside the private network can reach the cluster, and every node would need the token).

Cleanup: :meth:`NetnsCluster.close` (also on ``with`` exit and at interpreter exit) kills every
process in the cluster's namespaces, deletes them and the temp dir.  A crash is covered twice:
a watchdog process tears the cluster down when its owner dies or after ``lifetime_s``, and
:meth:`~NetnsCluster.start` first removes ``rmnet-*`` namespaces whose owner process is gone.

Needs root and iproute2 (``ip``; ``tc`` for :meth:`~NetnsCluster.cap`): :func:`unavailable` says
in one line why namespaces cannot be made here, for a test to skip with.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from rankmesh.errors import ClusterError

logger = logging.getLogger(__name__)

#: Every namespace and temp dir of every cluster starts with this; the next field is the owner's pid.
PREFIX = "rmnet"
#: Address range of the nodes: a /24 of 198.18.0.0/15, reserved for benchmarking (RFC 2544), so
#: that no real network uses it.
DEFAULT_NETWORK = "198.18.0.0/24"
#: Host numbers in the order nodes get them: three widths first (.9, .10, .100: string order
#: .10 < .100 < .9 differs from numeric order), then the rest.  A number is never given twice in
#: one cluster, so a node added after a kill never takes a dead node's address.
HOST_NUMBERS: tuple[int, ...] = (9, 10, 100, *range(11, 100), *range(101, 255))
#: The head's GCS port (inside the head's namespace, so clusters never clash on it).
GCS_PORT = 6379

#: Health checks for tests: a lost node is declared dead after 3 failed checks of 1 s (each
#: check times out after 1 s), about 3-6 s after it is cut off.  Passed as ``--system-config``.
TEST_HEALTH_CHECKS: Mapping[str, int] = MappingProxyType({
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
})
#: Ray's defaults (``src/ray/common/ray_config_def.h``): 5 failed checks, every 3 s, each allowed
#: 10 s: a cut-off node is declared dead after up to about a minute.
RAY_DEFAULT_HEALTH_CHECKS: Mapping[str, int] = MappingProxyType({
    "health_check_initial_delay_ms": 5000,
    "health_check_period_ms": 3000,
    "health_check_timeout_ms": 10000,
    "health_check_failure_threshold": 5,
})

#: The variable that gives a driver the address of the namespace it runs in, to bind Ray to it
#: (a driver inside the cluster binds that address, never the machine's).
ADDRESS_ENV = "RANKMESH_NETNS_ADDRESS"

#: Environment of every Ray process and driver of a cluster: multi-node on (the loopback setting
#: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` of :mod:`rankmesh.backends.ray.runtime` makes ``ray
#: start --address`` refuse to join, and a node's only interface here is its private one), no
#: usage stats, and token authentication off (the cluster is reachable only inside its private
#: namespaces, and every node and driver would need the token).
CLUSTER_ENV: Mapping[str, str] = MappingProxyType({
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
})

#: Object store per node: Ray's minimum is 75 MiB; nodes share the machine's /dev/shm.
OBJECT_STORE_BYTES = 80 << 20
#: How long ``ray start`` of one node may take (a Python process importing Ray, then the daemons).
RAY_START_TIMEOUT_S = 120.0
#: How often the watchdog looks at its owner.
WATCH_PERIOD_S = 1.0


@dataclass(frozen=True)
class NodeSpec:
    """What one node offers Ray: CPUs, custom resources, labels and its object store (bytes).

    ``NodeSpec.of({...})`` reads the keyword form of Ray's ``Cluster.add_node`` (``num_cpus``,
    ``resources``, ``labels``, ``object_store_memory``), so one list of nodes describes a
    simulated cluster and a namespaced one alike."""

    cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    object_store_bytes: int = OBJECT_STORE_BYTES

    @classmethod
    def of(cls, node: Mapping[str, Any]) -> "NodeSpec":
        known = {"num_cpus", "resources", "labels", "object_store_memory"}
        unknown = sorted(set(node) - known)
        if unknown:
            raise ValueError(f"node spec {dict(node)}: unknown keys {unknown}; a node takes {sorted(known)}")
        return cls(int(node.get("num_cpus", 1)), dict(node.get("resources", {})),
                   {str(k): str(v) for k, v in node.get("labels", {}).items()},
                   max(int(node.get("object_store_memory", OBJECT_STORE_BYTES)), OBJECT_STORE_BYTES))

    def ray_start_args(self) -> list[str]:
        args = [f"--num-cpus={self.cpus}", f"--object-store-memory={self.object_store_bytes}"]
        if self.resources:
            args.append(f"--resources={json.dumps(dict(self.resources))}")
        if self.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in self.labels.items()))
        return args


@dataclass(frozen=True)
class NetnsNode:
    """One node: ``name`` (``n0`` is the head), its ``address``, its ``namespace``, ``port``, its
    veth's name on the bridge (in the core namespace), and what it offers Ray (``spec``)."""

    name: str
    address: str
    namespace: str
    port: str
    head: bool = False
    spec: NodeSpec = field(default_factory=NodeSpec)


# ----- the machine: can namespaces be made, which exist, stale ones ---------------------------


def ip_binary() -> str | None:
    """Path of iproute2's ``ip`` (``/usr/sbin`` is often not on a non-root PATH)."""
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def tc_binary() -> str | None:
    """Path of iproute2's ``tc``."""
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None)


def unavailable() -> str | None:
    """Why namespaced clusters cannot be made here, in one line, or None when they can.

    Checks the platform, root, ``ip``, and then really makes (and removes) a namespace with a
    bridge and a veth pair, since a container may forbid either.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    ip = ip_binary()
    if ip is None:
        return "no `ip` command: install iproute2 (apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        for argv in (["netns", "add", probe], ["-n", probe, "link", "add", "br0", "type", "bridge"],
                     ["-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]):
            proc = subprocess.run([ip, *argv], capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                return f"`ip {' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}"
    finally:
        subprocess.run([ip, "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _require_ip() -> str:
    ip = ip_binary()
    if ip is None:
        raise ClusterError("no `ip` command: install iproute2 (apt-get install iproute2), or skip when "
                           "rankmesh.testing.cluster.unavailable() says why")
    return ip


def sh(argv: Sequence[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup command (``ip``, ``tc``); a failure raises with the command and its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """Names of the machine's named network namespaces (``ip netns list``)."""
    out = sh([_require_ip(), "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Processes living in ``namespace`` (``ip netns pids``; empty when it does not exist)."""
    proc = sh([_require_ip(), "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def remove_namespace(namespace: str, *, rounds: int = 20) -> list[int]:
    """SIGKILL every process in ``namespace`` (again, while Ray daemons still spawn), then delete it.

    Killing first matters: a namespace deleted while processes live in it survives nameless,
    and its processes can no longer be found.  Returns the pids killed.
    """
    killed: list[int] = []
    for _ in range(rounds):
        pids = [p for p in namespace_pids(namespace) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    else:
        logger.warning("processes still live in %s after %d rounds of SIGKILL: %s", namespace, rounds, namespace_pids(namespace))
    sh([_require_ip(), "netns", "del", namespace], check=False)
    return killed


def owner_pid(name: str) -> int | None:
    """The owner's pid in a cluster name ``rmnet-<pid>-...``, or None for another name."""
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1])


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove namespaces and temp dirs of clusters whose owner process is gone; the names removed."""
    removed = []
    for namespace in namespaces():
        pid = owner_pid(namespace)
        if pid is not None and not pid_alive(pid):
            remove_namespace(namespace)
            removed.append(namespace)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        pid = owner_pid(path.name)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if removed:
        logger.info("removed stale namespaced clusters: %s", ", ".join(removed))
    return removed


def check_network(network: str) -> ipaddress.IPv4Network:
    """``network`` parsed, after checking that no real network can be behind it.

    It must be private or reserved for benchmarking, and the host's namespace must have no
    address and no route in it (a default route is not counted: no node namespace has a link to
    the host's).  Raises ``ValueError`` saying which address or route is in the way.
    """
    net = ipaddress.ip_network(network)
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise ValueError(f"network {network} is not a private IPv4 range; use one like {DEFAULT_NETWORK} "
                         "(198.18.0.0/15 is reserved for benchmarking, RFC 2544)")
    if net.num_addresses < len(HOST_NUMBERS) or max(HOST_NUMBERS) >= net.num_addresses - 1:
        raise ValueError(f"network {network} is too small for host numbers up to {max(HOST_NUMBERS)}; use a /24")
    ip = _require_ip()
    in_the_way = []
    for iface in json.loads(sh([ip, "-j", "-4", "addr", "show"]).stdout or "[]"):
        for addr in iface.get("addr_info", ()):
            if ipaddress.ip_network(f"{addr['local']}/{addr.get('prefixlen', 32)}", strict=False).overlaps(net):
                in_the_way.append(f"address {addr['local']}/{addr.get('prefixlen')} on {iface.get('ifname')}")
    for route in json.loads(sh([ip, "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default" and ipaddress.ip_network(dst, strict=False).overlaps(net):
            in_the_way.append(f"route {dst} via {route.get('dev')} (table {route.get('table', 'main')})")
    if in_the_way:
        raise ValueError(f"network {network} is in use on this machine ({'; '.join(in_the_way)}); "
                         "pass another private range as network=, e.g. 198.19.0.0/24")
    return net


# ----- the cluster --------------------------------------------------------------------------------


class NetnsCluster:
    """A Ray cluster of ``num_nodes`` nodes (the first is the head), each its own network namespace.

    Use as ``with NetnsCluster(3) as cluster: ...`` or ``cluster = NetnsCluster(3).start()`` and
    :meth:`close`.  ``cpus`` is each node's ``--num-cpus``; or ``nodes`` gives each worker node's
    offer (:class:`NodeSpec`, in ``Cluster.add_node``'s keywords) and ``head`` the head's (CPU-less
    by default then); ``health`` the GCS health checks
    (:data:`TEST_HEALTH_CHECKS`); ``lifetime_s`` bounds the cluster's life: its watchdog tears it
    down then, or as soon as this process dies.  ``ray_env`` is added to every node's environment.
    """

    def __init__(
        self,
        num_nodes: int = 3,
        *,
        cpus: int = 1,
        nodes: Sequence[Mapping[str, Any]] | None = None,
        head: Mapping[str, Any] | None = None,
        network: str = DEFAULT_NETWORK,
        health: Mapping[str, int] = TEST_HEALTH_CHECKS,
        lifetime_s: float = 3600.0,
        ray_env: Mapping[str, str] | None = None,
    ) -> None:
        if nodes is not None:
            num_nodes = len(nodes) + 1
        if num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes}: a cluster needs at least its head node (num_nodes >= 1)")
        self.num_nodes = num_nodes
        self.cpus = cpus
        #: What each node offers, head first: ``nodes``' specs after ``head``'s (default: ``cpus``
        #: each; with ``nodes`` given, a CPU-less head, as a simulated cluster's).
        worker_specs = [NodeSpec.of(n) for n in nodes] if nodes is not None else [NodeSpec(cpus)] * (num_nodes - 1)
        head_spec = NodeSpec.of(head) if head is not None else NodeSpec(0 if nodes is not None else cpus)
        self.specs = [head_spec, *worker_specs]
        self.network = network
        self.health = dict(health)
        self.lifetime_s = lifetime_s
        self.ray_env = dict(ray_env or {})
        #: ``rmnet-<pid>-<tag>``: the stem of every namespace name and of the temp dir.
        self.stem = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.core = f"{self.stem}-core"
        self.temp_dir = Path(tempfile.gettempdir()) / self.stem
        #: Live nodes, head first.
        self.nodes: list[NetnsNode] = []
        self._hosts = iter(HOST_NUMBERS)
        self._count = 0
        self._net: ipaddress.IPv4Network | None = None
        self._watchdog: subprocess.Popen | None = None
        self._started = False
        self._ip = ""
        #: Seconds :meth:`start` took, for reports.
        self.start_seconds: float | None = None

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> "NetnsCluster":
        """Make the namespaces and start Ray on every node; returns once every node is alive."""
        if self._started:
            raise ClusterError(f"cluster {self.stem} is already started; make a new NetnsCluster for a second cluster")
        reason = unavailable()
        if reason is not None:
            raise ClusterError(f"cannot start a namespaced cluster: {reason}")
        t0 = time.monotonic()
        self._ip = _require_ip()
        remove_stale()
        self._net = check_network(self.network)
        self._started = True
        atexit.register(self.close)
        try:
            sh([self._ip, "netns", "add", self.core])
            self._watch()
            self.temp_dir.mkdir(parents=True, exist_ok=True)
            self._in(self.core, "link", "set", "lo", "up")
            self._in(self.core, "link", "add", "br0", "type", "bridge")
            self._in(self.core, "link", "set", "br0", "up")
            head = self._make_node()
            self._ray_start(head)
            workers = [self._make_node() for _ in range(self.num_nodes - 1)]
            self._ray_start(*workers)
            self.wait_for_nodes()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        logger.info("namespaced cluster %s: %d nodes up in %.1f s", self.stem, len(self.nodes), self.start_seconds)
        return self

    def close(self) -> None:
        """Kill every process of the cluster, delete its namespaces and temp dir (safe to call twice)."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.close)
        for namespace in [n for n in namespaces() if n.startswith(self.stem + "-")]:
            remove_namespace(namespace)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait(10)
        self.nodes = []

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def head(self) -> NetnsNode:
        """The head node (``n0``: GCS and a raylet)."""
        if not self.nodes:
            raise ClusterError(f"cluster {self.stem} has no nodes: call start() first (or it was closed)")
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The GCS address drivers join (``RAY_ADDRESS`` in :meth:`env`)."""
        return f"{self.head.address}:{GCS_PORT}"

    def node(self, which: NetnsNode | str) -> NetnsNode:
        """A live node by name (``"n1"``), address, or node."""
        key = which.name if isinstance(which, NetnsNode) else which
        for node in self.nodes:
            if key in (node.name, node.address):
                return node
        raise KeyError(f"no live node {key!r} in {self.stem}; live nodes: "
                       + ", ".join(f"{n.name} ({n.address})" for n in self.nodes))

    # -- faults --------------------------------------------------------------------------------

    def partition(self, which: NetnsNode | str) -> NetnsNode:
        """Cut ``which`` off: its bridge port goes down; its processes live on, TCP to it times out."""
        node = self.node(which)
        self._in(self.core, "link", "set", node.port, "down")
        return node

    def heal(self, which: NetnsNode | str) -> NetnsNode:
        """Undo :meth:`partition`: the node's bridge port goes up again.

        A node the GCS declared dead meanwhile stays dead (Ray 2.60): about 5 s after the heal its
        raylet exits ("mistakenly been marked as dead by the GCS"), its agents follow, its log
        monitor lives on, and no new node entry appears.  :meth:`kill_node` it and
        :meth:`add_node` for a replacement.
        """
        node = self.node(which)
        self._in(self.core, "link", "set", node.port, "up")
        return node

    def cap(self, which: NetnsNode | str, mbit: float | None) -> NetnsNode:
        """Cap the node's link at ``mbit`` Mbit/s each way (``tc tbf`` on both veth ends); None lifts the cap."""
        node = self.node(which)
        tc = tc_binary()
        if tc is None:
            raise ClusterError("no `tc` command: install iproute2 (apt-get install iproute2) to cap links")
        for namespace, dev in ((node.namespace, "eth0"), (self.core, node.port)):
            if mbit is None:
                sh([self._ip, "netns", "exec", namespace, tc, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            # burst: 1 ms at the rate, at least two full-size packets (tbf drops a packet larger
            # than its bucket); latency bounds the queue, as a slow link's buffer would.
            burst = max(3200, int(mbit * 1e6 / 8 / 1000))
            sh([self._ip, "netns", "exec", namespace, tc, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"])
        return node

    def kill_node(self, which: NetnsNode | str) -> NetnsNode:
        """SIGKILL every process of a worker node and remove its namespace (the GCS then declares it dead)."""
        node = self.node(which)
        if node.head:
            raise ValueError(f"kill_node({node.name}) would kill the head, and with it the cluster; call close() instead")
        remove_namespace(node.namespace)
        self.nodes.remove(node)
        return node

    def add_node(self, spec: Mapping[str, Any] | None = None, *, timeout: float = RAY_START_TIMEOUT_S) -> NetnsNode:
        """Start one more worker node (next address of :data:`HOST_NUMBERS`; ``spec`` as in
        ``nodes``, default ``cpus`` CPUs); returns once it is alive."""
        node = self._make_node(NodeSpec.of(spec) if spec is not None else NodeSpec(self.cpus))
        try:
            self._ray_start(node)
            self.wait_for_nodes([node.address], timeout)
        except BaseException:
            remove_namespace(node.namespace)
            self.nodes.remove(node)
            raise
        return node

    # -- running things inside -----------------------------------------------------------------

    def node_env(self) -> dict[str, str]:
        """Environment of the nodes' Ray processes: this process's, without ``RAY_ADDRESS``, with
        :data:`CLUSTER_ENV` and ``ray_env``."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        return {**env, **CLUSTER_ENV, **self.ray_env}

    def env(self, extra: Mapping[str, str] | None = None, node: NetnsNode | str | None = None) -> dict[str, str]:
        """Environment for a driver in ``node``'s namespace (the head's by default): :meth:`node_env` with
        ``RAY_ADDRESS`` (the head), :data:`ADDRESS_ENV` (the namespace's own address) and ``extra``."""
        target = self.head if node is None else self.node(node)
        return {**self.node_env(), "RAY_ADDRESS": self.address, ADDRESS_ENV: target.address, **(extra or {})}

    def command(self, argv: Sequence[str], node: NetnsNode | str | None = None) -> list[str]:
        """``argv`` wrapped to run inside a node's namespace (the head's by default)."""
        target = self.head if node is None else self.node(node)
        return [self._ip, "netns", "exec", target.namespace, *argv]

    def run(self, argv: Sequence[str], *, node: NetnsNode | str | None = None, timeout: float,
            env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in a node's namespace with :meth:`env` and wait (text output captured)."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(argv, node), env=self.env(env, node), text=True, timeout=timeout, **kwargs)

    def popen(self, argv: Sequence[str], *, node: NetnsNode | str | None = None,
              env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in a node's namespace with :meth:`env`; :meth:`close` kills it if still running."""
        return subprocess.Popen(self.command(argv, node), env=self.env(env, node), **kwargs)

    def run_python(self, code: str, *args: str, node: NetnsNode | str | None = None, timeout: float,
                   env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """``python -c code *args`` in a node's namespace (this interpreter); a Ray driver joins with
        ``ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[ADDRESS_ENV])``."""
        return self.run([sys.executable, "-c", code, *args], node=node, timeout=timeout, env=env, **kwargs)

    def wait_for_nodes(self, addresses: Sequence[str] | None = None, timeout: float = RAY_START_TIMEOUT_S) -> None:
        """Wait until the GCS lists ``addresses`` (default: every live node's) as alive (one short driver)."""
        want = sorted(addresses if addresses is not None else (n.address for n in self.nodes))
        proc = self.run_python(WAIT_CODE, json.dumps(want), str(timeout), timeout=timeout + 60)
        if proc.returncode != 0:
            raise ClusterError(f"nodes {want} of {self.stem} did not all come up within {timeout:g} s "
                               f"(logs under {self.temp_dir}):\n{proc.stderr[-3000:]}")

    # -- internals -----------------------------------------------------------------------------

    def _in(self, namespace: str, *argv: str) -> subprocess.CompletedProcess:
        return sh([self._ip, "-n", namespace, *argv])

    def _make_node(self, spec: NodeSpec | None = None) -> NetnsNode:
        assert self._net is not None
        index, self._count = self._count, self._count + 1
        address = str(self._net.network_address + next(self._hosts))
        if spec is None:
            spec = self.specs[index]
        node = NetnsNode(f"n{index}", address, f"{self.stem}-n{index}", f"p-n{index}", head=index == 0, spec=spec)
        sh([self._ip, "netns", "add", node.namespace])
        self._in(self.core, "link", "add", node.port, "type", "veth", "peer", "name", "eth0", "netns", node.namespace)
        self._in(self.core, "link", "set", node.port, "master", "br0", "up")
        self._in(node.namespace, "link", "set", "lo", "up")
        self._in(node.namespace, "addr", "add", f"{address}/{self._net.prefixlen}", "dev", "eth0")
        self._in(node.namespace, "link", "set", "eth0", "up")
        self.nodes.append(node)
        return node

    def _ray_start(self, *nodes: NetnsNode) -> None:
        """``ray start`` on each node at once (its daemons stay in its namespace; ``ray start`` returns)."""
        procs = []
        for node in nodes:
            temp = self.temp_dir / node.name
            argv = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={node.address}",
                    *node.spec.ray_start_args(), f"--temp-dir={temp}", "--disable-usage-stats"]
            if node.head:
                argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                         f"--system-config={json.dumps(self.health)}"]
            else:
                argv += [f"--address={self.address}"]
            log = open(self.temp_dir / f"ray-start-{node.name}.log", "w")
            procs.append((node, log, subprocess.Popen(self.command(argv, node), env=self.node_env(), stdout=log,
                                                      stderr=subprocess.STDOUT)))
        failed = []
        for node, log, proc in procs:
            try:
                code = proc.wait(RAY_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "timeout"
            log.close()
            if code != 0:
                text = (self.temp_dir / f"ray-start-{node.name}.log").read_text(errors="replace")[-2000:]
                failed.append(f"{node.name} ({node.address}): exit {code}\n{text}")
        if failed:
            raise ClusterError("`ray start` failed in its namespace:\n" + "\n".join(failed))

    def _watch(self) -> None:
        """Start the watchdog: it tears this cluster down when this process dies or after ``lifetime_s``."""
        argv = [sys.executable, "-m", __name__, "watch", str(os.getpid()), self.stem, str(self.lifetime_s)]
        # The watchdog imports this module: give it the tree this process imported it from.
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        self._watchdog = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)


#: The wait driver (run in the head's namespace): polls ``ray.nodes()`` until every address of
#: argv[1] (JSON list) is alive, for at most argv[2] seconds.
WAIT_CODE = """
import json, os, sys, time, ray
want, end = sorted(json.loads(sys.argv[1])), time.monotonic() + float(sys.argv[2])
ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["RANKMESH_NETNS_ADDRESS"], logging_level="ERROR")
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if set(want) <= set(alive):
        break
    if time.monotonic() > end:
        sys.exit(f"alive nodes {alive}, expected {want}")
    time.sleep(0.2)
"""


def watch(owner: int, stem: str, lifetime_s: float) -> None:
    """Watchdog body: tear down the cluster ``stem`` once ``owner`` is gone or ``lifetime_s`` passed.

    Ends by itself as soon as the cluster's namespaces are gone (the owner closed it).
    """
    end = time.monotonic() + lifetime_s
    while True:
        time.sleep(WATCH_PERIOD_S)
        mine = [n for n in namespaces() if n.startswith(stem + "-")]
        if not mine:
            return
        if not pid_alive(owner) or time.monotonic() > end:
            for namespace in mine:
                remove_namespace(namespace)
            shutil.rmtree(Path(tempfile.gettempdir()) / stem, ignore_errors=True)
            return


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "watch":
        watch(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
    else:
        sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'rankmesh.testing.cluster'} watch OWNER_PID STEM LIFETIME_S")
