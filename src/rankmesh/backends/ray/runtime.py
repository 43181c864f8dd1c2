"""Connecting the controller to Ray: join a cluster, or start a private one bound to loopback.

Why a helper instead of a bare ``ray.init`` call: a Ray started with defaults on a machine with a
network interface advertises that interface and its gRPC servers listen on every address.  A
local, embedded Ray is a development convenience and must stay on 127.0.0.1, which takes three
settings together (measured with Ray 2.60):

* ``_node_ip_address="127.0.0.1"`` for the head node;
* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment the Ray processes inherit, without
  which workers still report (and bind) the machine's interface address;
* ``include_dashboard=False`` unless the caller passes ``include_dashboard=True`` (the dashboard
  opens another port; when asked for, it binds 127.0.0.1).

Joining an existing cluster (``address=`` or ``RAY_ADDRESS``) changes none of them: that cluster's
own configuration decides where its processes listen.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import ray
from ray._private import ray_constants

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
"""The only address an embedded Ray (and the test clusters) may bind to."""

DETACHED_NAMESPACE = "rankmesh"
"""Namespace of named (detached) actors, fixed so another driver can find them by name alone."""

#: Environment a *local* Ray needs so that every process it spawns stays on loopback.
LOCAL_RAY_ENV: Mapping[str, str] = MappingProxyType({
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
})


@dataclass(frozen=True)
class RayConnection:
    """How this process is connected to Ray (``started_here``: we launched a local Ray)."""

    address: str | None
    started_here: bool

    def close(self) -> None:
        """Shut Ray down if this connection started it; a joined cluster is left alone."""
        if self.started_here and ray.is_initialized():
            ray.shutdown()


def set_loopback_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Put :data:`LOCAL_RAY_ENV` into ``env`` (``os.environ`` by default) without overriding."""
    target = os.environ if env is None else env
    for key, value in LOCAL_RAY_ENV.items():
        target.setdefault(key, value)
    return target  # type: ignore[return-value]


def ensure_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store_memory: int | None = None,
    namespace: str | None = None,
    **init_kwargs: Any,
) -> RayConnection:
    """Make sure this process is a Ray driver (or already runs inside Ray).

    Already connected: nothing changes.  ``address`` (or ``RAY_ADDRESS``) given: join that
    cluster.  Otherwise start a new local Ray on loopback with the dashboard off (never attach
    to another Ray found on the machine); ``num_cpus`` etc. only apply to that case.
    """
    if ray.is_initialized():
        return RayConnection(address=_current_address(), started_here=False)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    init_kwargs.setdefault("logging_level", logging.WARNING)
    if address:
        logger.info("joining the Ray cluster at %s", address)
        if _is_loopback_address(address):
            # A cluster on 127.0.0.1 (e.g. simulated nodes): without this Ray rewrites the
            # address to the machine's interface and the connection hangs.
            set_loopback_env()
            loopback_in_this_process()
        ray.init(address=address, namespace=namespace, **init_kwargs)
        return RayConnection(address=_current_address(), started_here=False)
    set_loopback_env()
    loopback_in_this_process()
    logger.info("starting a local Ray on %s (num_cpus=%s, num_gpus=%s)", LOOPBACK, num_cpus, num_gpus)
    # address="local": always start a new Ray.  Without it ray.init() attaches to whatever Ray
    # it finds on this machine (another user's, or a parent process's test session).
    # The dashboard stays off unless asked for (include_dashboard=True), and then on loopback.
    init_kwargs.setdefault("include_dashboard", False)
    if init_kwargs["include_dashboard"]:
        init_kwargs.setdefault("dashboard_host", LOOPBACK)
    with quiet_embedded_ray(num_cpus, init_kwargs):
        ray.init(  # binds 127.0.0.1 only (LOOPBACK)
            address="local",
            _node_ip_address=LOOPBACK,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_memory,
            namespace=namespace,
            **init_kwargs,
        )
    return RayConnection(address=_current_address(), started_here=True)


class _DropTokenNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled" notice, which says only that its default holds."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


#: The logger Ray's notice comes from (Ray 2.5x-2.6x); another name only lets the notice through.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def quiet_embedded_ray(num_cpus: int | None, init_kwargs: dict[str, Any]) -> Iterator[None]:
    """Around an embedded Ray's ``ray.init``: no notices about Ray's own defaults, the defaults kept.

    * Token authentication stays on (Ray's default for a new local cluster, unless the caller set
      ``RAY_AUTH_MODE``) because it protects something even on loopback: another user of this
      machine can reach 127.0.0.1's ports, and the token (``~/.ray/auth_token``, readable by us
      alone) keeps them out.  Only the warning that says it is on is dropped, during this start.
    * ``worker_maximum_startup_concurrency = num_cpus``: Ray warns once a node has started more
      worker processes than a few times its *physical* cores, but a group starts one actor per
      scheduling slot at once by design (the slots are what ``num_cpus`` declares), so the
      warning would fire on every start of a group bigger than the machine.  Counting the
      declared slots silences it for exactly the workers that were asked for.  Ray would then
      also prestart that many idle workers when the driver connects (a 64-slot Ray: 64 idle
      processes on a 2-core machine), so prestarting is off: only the processes a program asks
      for start, as fast as before (measured: 16 one-CPU actors in 4-5 s either way).
    """
    if num_cpus:
        config = dict(init_kwargs.get("_system_config") or {})
        config.setdefault("worker_maximum_startup_concurrency", int(num_cpus))
        # ... without prestarting that many idle workers when the driver connects: only the
        # processes a program asks for start (measured: 16 idle workers doubled a 16-slot start).
        config.setdefault("prestart_worker_first_driver", False)
        init_kwargs["_system_config"] = config
    notice, drop = logging.getLogger(RAY_AUTH_LOGGER), _DropTokenNotice()
    notice.addFilter(drop)
    try:
        yield
    finally:
        notice.removeFilter(drop)


def _is_loopback_address(address: str) -> bool:
    """Whether ``host:port`` names this machine's loopback (``ray://`` and ``auto`` do not)."""
    host = address.rsplit(":", 1)[0] if ":" in address and "://" not in address else ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_in_this_process() -> None:
    """Make an already-imported Ray treat 127.0.0.1 as this node's address.

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is first imported; when
    the variable was not set then, ``ray.init`` silently replaces ``_node_ip_address="127.0.0.1"``
    by the machine's interface address.  Called before starting or joining a loopback Ray.
    """
    if getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):
        logger.debug("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; applying it now")
        ray_constants.ENABLE_RAY_CLUSTER = False


def _current_address() -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # pragma: no cover - older Ray or not connected
        return None


def node_ip_address() -> str:
    """This process's node address as Ray sees it (127.0.0.1 on a loopback cluster)."""
    return ray.util.get_node_ip_address()


def alive_nodes() -> dict[str, dict[str, Any]]:
    """Node id (hex) -> the ``ray.nodes()`` record, for live nodes only."""
    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}


#: ``/proc/<pid>/comm`` of Ray's per-node daemon, the process that starts a node's workers.
RAYLET_NAME = "raylet"


def _parent_and_name(pid: int) -> tuple[int, str] | None:
    """``(ppid, comm)`` of ``pid`` from ``/proc/<pid>/stat`` (comm may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2 :].split()[1]), name


def worker_raylet_pid() -> int | None:
    """Pid of the raylet that started this worker process (its node's raylet), else ``None``.

    Ray tells its workers in ``RAY_RAYLET_PID``; that pid is used only if it is an ancestor of
    this process named ``raylet``, and without it the nearest such ancestor is (workers are the
    raylet's children; a runtime-env setup process may sit between).  Every Ray worker process
    of the node descends from it: the tracer to declare with
    :func:`rankmesh.peermem.allow_peer_reads` so that exactly they may read this process.
    """
    told = os.environ.get("RAY_RAYLET_PID", "")
    pid = os.getpid()
    for _ in range(16):  # a worker sits one or two levels below its raylet
        found = _parent_and_name(pid)
        if found is None or found[0] <= 0:
            return None
        pid = found[0]
        parent = _parent_and_name(pid)
        if parent is None:
            return None
        if parent[1] == RAYLET_NAME and (not told.isdigit() or int(told) == pid):
            return pid
    return None


def health_window_s() -> float:
    """How far apart the GCS may declare nodes dead that were all cut off at one moment (seconds):
    one health check's period plus its timeout, as this cluster is configured (each node's checks
    run on their own timer, and each may take up to the timeout)."""
    config = ray._config  # noqa: SLF001 - the cluster's system config, as this process received it
    return (config.health_check_period_ms() + config.health_check_timeout_ms()) / 1000


def node_death_window_s() -> float:
    """How long after a node stops answering the GCS declares it dead, at most (seconds): its failed
    health checks in a row, each a period apart, plus the last one's timeout, as configured."""
    config = ray._config  # noqa: SLF001 - the cluster's system config, as this process received it
    return (config.health_check_failure_threshold() * config.health_check_period_ms()
            + config.health_check_timeout_ms()) / 1000


def referenced_objects() -> int:
    """How many objects Ray's reference table in this process lists: those it holds, and those it
    owns that another process still borrows (an owner keeps the entry until its borrowers let go).

    Ray has no public accessor; its ``ray memory`` reads the same table.  Where this Ray lacks it,
    every object counts as referenced (1), so that nothing that may own data is ended."""
    worker = ray._private.worker.global_worker  # noqa: SLF001 - no public accessor
    counts = getattr(getattr(worker, "core_worker", None), "get_all_reference_counts", None)
    return 1 if counts is None else len(counts())


def raylet_pids() -> list[int]:
    """Pids of the raylets this driver started (they own the object store's file), else ``[]``.

    Read from Ray's node object, which only a driver that started Ray holds; a driver attached
    to a running cluster gets ``[]`` (its receives then fall back to copies unless the kernel
    lets it open ``/proc/self/map_files``).
    """
    node = getattr(ray._private.worker, "_global_node", None)  # noqa: SLF001 - no public accessor
    procs = getattr(node, "all_processes", None) or {}
    pids = []
    for info in procs.get("raylet", []):
        pid = getattr(getattr(info, "process", None), "pid", None)
        if isinstance(pid, int):
            pids.append(pid)
    return pids

