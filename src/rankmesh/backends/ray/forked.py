"""Forked ranks on Ray: the holder of a group's forked ranks on each node, their routes, and the keeper of each node's warm processes.

Why: a group started with ``process_model="fork"`` forks each rank from its node's warm process
(:mod:`.warm`) instead of importing torch, rankmesh and megatron-core again in a Ray worker per
rank.  Ray still places and accounts: each rank's bundle stays reserved by its placement group,
and one :class:`ForkedRanks` per group and node, a Ray actor that asks for no resources and
imports neither torch nor the user's modules, forks the group's ranks on that node.  A rank's
process is a child of the warm process, which Ray does not know of; so:

* **Callers hold a route, not an actor.**  ``hosts.actors[rank]`` of a forked group is a
  :class:`RankRoute`: ``route.execute.remote(...)`` runs the host method on the rank through its
  node's holder, which forwards it over one of two Unix socket channels, the default one and the
  control one (a *lane* each, one thread), so a caller's calls keep their order and
  ``stacks``/``ping`` answer while a call blocks, as with a rank in its own actor.  The holder is
  an async actor, which Ray runs out of order: each call carries its caller's number for it
  (:class:`_Submitter`) and waits for the caller's earlier calls of that rank and lane.  A call
  session's ring needs no holder: the rank attaches to the writer's socket itself
  (:meth:`.host.WorkerHost.open_session`).
* **A death is told at once.**  The holder watches each rank's pidfd; from the moment a rank's
  process exits, its calls raise :class:`~rankmesh.errors.ForkedRankGone`, which the group reads
  as a process death (:data:`.waiting.PROCESS_DIED`).  A rank exits when its holder does (the warm
  process watches the holder's pid, and the rank's channels close).  :func:`kill_host` kills one
  rank; killing the holder kills the node's ranks of the group.
* **Data through the holder.**  A call's header and the arguments inside it reach the rank as the
  bytes they are; the rank's answer goes back sealed (:class:`.warm.Sealed`: its pickle, opened
  where Ray unpickles it, not in the holder).  Arguments in Ray's store (over 100 KiB, off the
  caller's node or on Ray's tasks; a future passed along) are stored sealed by the caller
  (:func:`.warm.seal`): this process is a holder (:func:`.warm.pass_sealed_in_this_process`), so
  it reads them unopened and the rank opens them; a future's parts the rank then fetches through
  its holder.  The call session (blocking calls on the node, large arguments in memory files
  included) never goes through it; Ray's tasks (non-blocking calls, futures passed along, node
  agents' data calls) do.
* **Ray's objects stay in the holder.**  An ObjectRef on its way to a rank (in a call's
  arguments, or in a value the rank fetched) is kept in the rank's :class:`RefTable`, and the
  rank gets a :class:`.warm.RefToken` for it; a token in the rank's answer turns back into the
  reference.  The rank's object transport (reshard's ``put``/``get``/``wait_any``,
  :class:`.warm.HolderObjects`) asks the holder on a third channel, served by a thread per rank
  (:func:`_serve_objects`).  The references a call brought or put are let go when that call
  answers (those in its answer live on in Ray's, as a Ray actor's would).
* **The rank's environment is a Ray worker's in its bundle**: the holder's, with
  ``OMP_NUM_THREADS`` as Ray sets it for the bundle's CPUs, and on a bundle with a GPU share the
  devices a task in the bundle reads (:func:`bundle_devices`, once per fork).

A :class:`WarmKeeper` per node (a detached named actor in rankmesh's namespace, ``num_cpus=0``)
starts the node's warm processes, one per import set and ``sys.path`` (each forked from the
base warm process of its ``sys.path``, which imported torch and rankmesh once: :mod:`.warm`),
and restarts one that died or whose source files changed on disk since it imported them, or
refuses with why when its modules started a thread or CUDA.  A warm process unused for
:data:`.warm.IDLE_S` exits by itself, so a long-lived cluster does not keep megatron-core
imported for a driver long gone.  What a forked rank cannot do is
listed in ``docs/ray_backend.md`` ("Process models").
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import ray

from rankmesh.errors import BackendError, ForkedRankGone, ForkRefused, RayHandleInChannel

from .hostapi import ANSWER_PARTS, BARE_SLOT_METHODS, CONTROL_GROUP, HOST_METHODS, SLOT_METHODS, HostPlace
from .reshard import RayObjects
from .runtime import DETACHED_NAMESPACE
from .warm import (ForkRequest, NoHandles, Sealed, encode_message, fork_rank, pass_sealed_in_this_process, receive_message,
                   kill_by_pidfd, receive_payload, send_encoded, sendable, start_warm)

logger = logging.getLogger(__name__)

#: The process models a group may choose: one Ray actor per rank, or ranks forked from a warm process.
PROCESS_MODELS: tuple[str, ...] = ("ray", "fork")
#: How long a warm process may take to import its modules (seconds).
WARM_START_S = 300.0
#: How long a forked rank may take to build its host and say so (seconds).
FORK_START_S = 120.0
#: Ray's switch for its automatic ``ray.init()`` on first use, set off for warm processes.
NO_AUTO_CONNECT = ("RAY_ENABLE_AUTO_CONNECT", "0")
#: How long a group's holder on a node may take to answer before another is started there (seconds).
HOLDER_PING_S = 10.0
#: The keeper actor's name, per node.
KEEPER_NAME = "rankmesh_warm_keeper_{node_id}"


#: The environment variable that sets the process model of groups that do not choose one.
PROCESS_MODEL_ENV = "RANKMESH_PROCESS_MODEL"


class ProcessChoice(NamedTuple):
    """A group's process model, and whether a refusal to fork its modules (:class:`ForkRefused`)
    starts Ray actors instead (``fall_back``: the model was the default, not asked for)."""

    model: str
    fall_back: bool = False


def choose_process_model(process_model: str | None, classes: Sequence[type],
                         environ: Mapping[str, str] | None = None) -> ProcessChoice:
    """The process model of a group of worker ``classes``: ``process_model`` if given, else the
    ``RANKMESH_PROCESS_MODEL`` setting, else ``"fork"`` when every class is rankmesh's own (none
    calls Ray inside a rank), falling back to ``"ray"`` should forking be refused, and ``"ray"``
    for any other class (it may call Ray, which a forked rank cannot)."""
    environ = os.environ if environ is None else environ
    if process_model is not None or environ.get(PROCESS_MODEL_ENV, "").strip():
        return ProcessChoice(process_model_of(process_model, environ))
    own = all(cls.__module__.split(".")[0] == "rankmesh" for cls in classes)
    return ProcessChoice("fork", fall_back=True) if classes and own else ProcessChoice("ray")


def process_model_of(process_model: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``process_model`` checked, or when ``None`` the ``RANKMESH_PROCESS_MODEL`` setting (``"ray"`` if unset)."""
    if process_model is None:
        given = (os.environ if environ is None else environ).get(PROCESS_MODEL_ENV, "").strip().lower() or "ray"
        if given not in PROCESS_MODELS:
            raise BackendError(f"{PROCESS_MODEL_ENV}={given!r} is not a process model: set it to one of "
                               f"{list(PROCESS_MODELS)}, or unset it")
        return given
    if process_model not in PROCESS_MODELS:
        raise BackendError(f"process_model must be one of {list(PROCESS_MODELS)}, got {process_model!r}")
    return process_model


class WarmKeeper:
    """One node's warm processes, by import set: started on first need, replaced when dead or stale.

    Each ``sys.path`` has a base warm process (the host's modules imported) that this keeper
    starts; each import set's warm process is forked from its base (:func:`.warm.start_warm`)."""

    def __init__(self) -> None:
        self._token = uuid.uuid4().hex[:12]  # names this keeper's sockets (abstract: :func:`.warm.abstract`)
        self._started = 0
        #: sys.path -> the base warm process, its socket, the source files it read.
        self._bases: dict[tuple[str, ...], tuple[subprocess.Popen, str, list[tuple[str, int, int]]]] = {}
        #: (modules, sys.path) -> the warm process (a pidfd on it, its pid), its socket, the source files it read.
        self._warm: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[int, int, str, list[tuple[str, int, int]]]] = {}

    def address(self, modules: Sequence[str], sys_path: Sequence[str]) -> str:
        """The socket of the warm process that imported ``modules`` on ``sys_path`` (the ranks'),
        started (and waited for) if need be."""
        key = (tuple(sorted(set(modules))), tuple(sys_path))
        base = self._base(key[1])
        found = self._warm.pop(key, None)
        if found is not None:
            pidfd, pid, address, files = found
            why = "it exited" if _exited(pidfd) else "a source file changed" if _changed(files) else None
            if why is None:
                self._warm[key] = found
                return address
            kill_by_pidfd(pidfd)
            logger.info("warm process %d for %s retired (%s)", pid, key[0], why)
        self._started += 1
        address = f"rankmesh-warm-{self._token}-{self._started}"
        said = start_warm(base, address, key[0], WARM_START_S)
        pidfd = os.pidfd_open(said["pid"])
        if said["unsafe"]:
            kill_by_pidfd(pidfd)
            raise ForkRefused(f"ranks cannot be forked for worker modules {list(key[0])}: {said['unsafe']}. Start "
                              f"the group with process_model='ray', or have the module start that at first use")
        for name, error in said["failed"].items():
            logger.warning("the warm process for %s could not import %s: %s (each rank will import it)", key[0], name, error)
        self._warm[key] = (pidfd, said["pid"], address, [tuple(f) for f in said["files"]])
        return address

    def processes(self) -> list[tuple[tuple[str, ...], int]]:
        """(modules, pid) of each live warm process of an import set (for tests and tools)."""
        return [(key[0], pid) for key, (pidfd, pid, _, _) in self._warm.items() if not _exited(pidfd)]

    def _base(self, sys_path: tuple[str, ...]) -> str:
        """The socket of the base warm process for ``sys_path``, started if need be.  A base that
        exited or read a source file changed since is replaced, and its import sets' warm
        processes (its children, which die with it) are forgotten."""
        found = self._bases.get(sys_path)
        if found is not None:
            process, address, files = found
            why = "it exited" if process.poll() is not None else "a source file changed" if _changed(files) else None
            if why is None:
                return address
            process.kill()
            process.wait()
            logger.info("base warm process %d retired (%s)", process.pid, why)
            for key in [k for k in self._warm if k[1] == sys_path]:
                os.close(self._warm.pop(key)[0])  # killed with its base
        self._started += 1
        address = f"rankmesh-warm-{self._token}-base-{self._started}"
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each rank sets its own
        # Ray read in a forked rank must not connect it as a hidden driver of its own (it has no
        # Ray worker): Ray's automatic ray.init() is off for the warm processes and their forks.
        env[NO_AUTO_CONNECT[0]] = NO_AUTO_CONNECT[1]
        process = subprocess.Popen([sys.executable, "-m", "rankmesh.backends.ray.warm", address, json.dumps(sys_path)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        relay = _Relay(process.stderr)
        ready, _, _ = select.select([process.stdout], [], [], WARM_START_S)
        line = process.stdout.readline() if ready else b""
        if not line:
            process.kill()
            process.wait()
            raise BackendError(f"the base warm process did not start within {WARM_START_S:g} s "
                               f"(exit code {process.returncode}); its log ends:\n{relay.tail()}")
        said = json.loads(line)
        for name, error in said["failed"].items():
            logger.warning("the base warm process could not import %s: %s (each rank will import it)", name, error)
        self._bases[sys_path] = (process, address, [tuple(f) for f in said["files"]])
        return address


class _Relay:
    """A warm process's stderr copied to the keeper's (Ray keeps it with the keeper's log: nothing
    of rankmesh's own on disk), its last lines kept to explain a failed start."""

    def __init__(self, stream: Any) -> None:
        self._lines: collections.deque[bytes] = collections.deque(maxlen=40)
        self._thread = threading.Thread(target=self._copy, args=(stream,), name="rankmesh-warm-log", daemon=True)
        self._thread.start()

    def _copy(self, stream: Any) -> None:
        for line in stream:
            self._lines.append(line)
            os.write(2, line)

    def tail(self) -> str:
        self._thread.join(timeout=5.0)  # the process is gone: its last lines are in
        return b"".join(self._lines).decode(errors="replace")[-2000:]


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd reads ready)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _changed(files: Sequence[tuple[str, int, int]]) -> bool:
    for path, mtime_ns, size in files:
        try:
            st = os.stat(path)
        except OSError:
            return True
        if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
            return True
    return False


def keeper_of(node_id: str) -> Any:
    """The :class:`WarmKeeper` of node ``node_id``, started there if none is up yet.

    Detached, in rankmesh's namespace: one keeper per node serves every group and driver (a
    group's ranks outlive the handle that started them), and it ends with its node's raylet."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(num_cpus=0)(WarmKeeper).options(
        name=KEEPER_NAME.format(node_id=node_id), namespace=DETACHED_NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote()


@dataclass(frozen=True)
class Forking:
    """How a group's ranks are forked: the modules its warm processes import, and its holder on each node.

    ``holders``: node id -> the group's :class:`ForkedRanks` there (and its first ping, answered
    once it started), started with the first rank the group forks on that node and killed with
    the group (:meth:`close`)."""

    modules: tuple[str, ...]
    holders: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of_roles(cls, roles: Mapping[str | None, Any], preload: Sequence[str]) -> "Forking":
        """The worker classes' modules (a class defined in ``__main__`` travels by value) and ``preload``."""
        modules = {getattr(role.cls, "__module__", None) for role in roles.values()} | set(preload)
        return cls(tuple(sorted(m for m in modules if m and m != "__main__")))

    def start(self, slot: Any, rank: int | None, group_name: str, resources: Mapping[str, Any],
              options: Mapping[str, Any]) -> RankRoute:
        """Fork ``rank`` for bundle ``slot`` (``resources``: a rank's share of it; ``options``: the
        group's Ray options) on the node Ray placed the bundle on; its route, at once (the fork
        goes on meanwhile, and the rank's first call waits for it)."""
        from ray.util import placement_group_table  # noqa: PLC0415 - Ray's utilities load on use
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        node = placement_group_table(slot.pg)["bundles_to_node_id"].get(slot.bundle_index) or slot.node_id
        holder = self._holder(node, group_name, options)
        devices: list[Any] = []
        if any(v for k, v in resources.items() if k != "num_cpus"):  # a GPU share: ask a worker in the bundle
            devices.append(ray.remote(bundle_devices).options(
                **resources, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.pg, placement_group_bundle_index=slot.bundle_index),
                **_runtime_env(options)).remote())
        key = uuid.uuid4().hex
        holder.fork.remote(key, rank, slot.pg.id.hex(), float(resources.get("num_cpus", 1.0)), devices)
        return RankRoute(holder, key)

    def _holder(self, node: str, group_name: str, options: Mapping[str, Any]) -> Any:
        """The group's holder on ``node``, started there if it has none or its holder died.

        A holder still starting (its warm process importing) is used as it is: its ranks' first
        calls wait for it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        found = self.holders.get(node)
        if found is not None:
            holder, started = found
            if not ray.wait([started], timeout=0)[0]:
                return holder
            try:
                ray.get(started)
                ray.get(holder.ping.remote(), timeout=HOLDER_PING_S)
                return holder
            except (ray.exceptions.RayError, TimeoutError):  # dead (its ranks with it): start another
                logger.info("worker group %s: the holder of its forked ranks on node %s is gone; starting another",
                            group_name, node)
        holder = holder_actor_class().options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            **_runtime_env(options),
        ).remote(group_name, self.modules)
        self.holders[node] = (holder, holder.ping.remote())
        return holder

    def close(self) -> None:
        """Kill the group's holders, and with them every rank they forked."""
        for holder, _ in self.holders.values():
            try:
                ray.kill(holder, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already dead
                logger.debug("killing %s: %s", holder, exc)
        self.holders.clear()


def _runtime_env(options: Mapping[str, Any]) -> dict[str, Any]:
    """The group's ``runtime_env`` among its Ray ``options``, for what runs beside its ranks (their
    holder, the read of a bundle's devices): the rest of the options are a rank's."""
    return {"runtime_env": options["runtime_env"]} if options.get("runtime_env") else {}


class RefTable:
    """The ObjectRefs a holder keeps for its forked rank, by number (the rank's :class:`.warm.RefToken`)."""

    def __init__(self) -> None:
        self._refs: dict[int, ray.ObjectRef] = {}
        self._next = 0
        self._lock = threading.Lock()

    def hold(self, ref: ray.ObjectRef) -> int:
        with self._lock:
            self._next += 1
            self._refs[self._next] = ref
            return self._next

    def ref(self, number: int) -> ray.ObjectRef:
        with self._lock:
            found = self._refs.get(number)
        if found is None:
            raise BackendError(f"object reference {number} is no longer held by this forked rank's holder: a forked rank "
                               "may use a reference only during the call that brought or put it; keep the value "
                               "instead, or start the group with process_model='ray'")
        return found

    def seal(self, payload: bytearray, numbers: list[int]) -> Sealed:
        """The rank's pickle ``payload`` as Ray will carry it, with the references its tokens ``numbers`` stand for."""
        return Sealed(payload, tuple((n, self.ref(n)) for n in numbers))

    def mark(self) -> int:
        """The number after which references come from now on (for :meth:`release_after`)."""
        with self._lock:
            return self._next

    def release_after(self, mark: int) -> None:
        """Let go of every reference held since ``mark``."""
        with self._lock:
            for number in [n for n in self._refs if n > mark]:
                del self._refs[number]


class _ToRank(NoHandles):
    """What a holder sends its rank: an ObjectRef travels as a number its holder keeps it under
    (:class:`RefTable`), a :class:`.warm.Sealed` value as it came (the rank opens it); an actor
    handle is refused."""

    def __init__(self, file: Any, refs: RefTable) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_id(self, obj: Any) -> Any:
        return self.refs.hold(obj) if isinstance(obj, ray.ObjectRef) else None


class _Channel:
    """One end of a holder's channel to its rank: a request, then its answer.

    ``scoped``: the references held for the rank since a call began are let go when it answers
    (the default channel's calls; control calls carry none).  ``who``: the rank, for errors."""

    def __init__(self, conn: socket.socket, refs: RefTable, scoped: bool, who: str) -> None:
        self.conn = conn
        self.refs = refs
        self.scoped = scoped
        self.who = who

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mark = self.refs.mark()
        try:
            return self._call(name, args, kwargs)
        finally:
            if self.scoped:
                self.refs.release_after(mark)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            payload = encode_message((name, args, kwargs), functools.partial(_ToRank, refs=self.refs))
        except RayHandleInChannel as exc:
            raise BackendError(
                f"{name}: an argument holds a Ray {exc.kind} inside it, and a forked rank has no Ray worker to call it: "
                f"start the group with process_model='ray'") from None
        try:
            send_encoded(self.conn, payload)
            status, said = receive_message(self.conn, self.refs.ref)
            payloads = [receive_payload(self.conn) for _ in said] if status == "ok" else []
        except (EOFError, OSError) as exc:
            raise ForkedRankGone(f"{self.who} is gone under {name} ({exc or 'its channel closed'})") from None
        if status == "error":
            raise said
        # Passed on unopened: whoever reads them from Ray rebuilds the values, and this holder imports nothing for them.
        parts = tuple(self.refs.seal(payload, numbers) for payload, numbers in zip(payloads, said))
        return parts if name in ANSWER_PARTS else parts[0]


#: The lane of a host method's calls in a :class:`ForkedRanks` (:func:`lane_of`): calls of one lane
#: run one at a time, in the order each caller sent them.
DEFAULT_LANE = "default"
#: How long a call waits for an earlier one of the same caller and rank that never arrives (Ray
#: failed it before it ran, say) before it goes on without it (seconds).
TURN_WAIT_S = 30.0
#: The call slots' names (:data:`.hostapi.SLOT_METHODS`, :data:`.hostapi.BARE_SLOT_METHODS`): default lane.
SLOT_SET = frozenset(SLOT_METHODS) | frozenset(BARE_SLOT_METHODS)


def lane_of(name: str) -> str:
    """The lane host method ``name`` runs on: the control lane for control calls (they answer while a
    call blocks), the default lane for the rest and the call slots."""
    if name in HOST_METHODS:
        return CONTROL_GROUP if HOST_METHODS[name] == CONTROL_GROUP else DEFAULT_LANE
    if name in SLOT_SET:
        return DEFAULT_LANE
    raise AttributeError(f"a forked rank's host has no remote method {name!r}")


@dataclass
class _ForkedRank:
    """One forked rank as its node's holder keeps it: its process, channels, lanes and references."""

    rank: int | None
    pid: int
    refs: RefTable
    channels: dict[str, _Channel]
    #: One thread per lane: a lane's calls run in the order they were handed to it.
    lanes: dict[str, ThreadPoolExecutor]
    gone: str | None = None

    def lost(self, why: str) -> None:
        """The rank's process is gone: later calls raise at once; its channels close once their calls end."""
        self.gone = why
        for lane, executor in self.lanes.items():
            executor.submit(self.channels[lane].conn.close)
            executor.shutdown(wait=False)


class CallHead(NamedTuple):
    """A call to a forked rank as it travels to the node's holder: the rank, lane and method, its
    caller's number for it, and the method's arguments.

    One argument of Ray's call: Ray pickles each argument on its own (about 65 us each here), and
    resolves none nested in it, so a stored argument is read after the call's turn, not before."""

    key: str
    lane: str
    caller: str
    number: int
    name: str
    args: list[Any]
    kwargs: dict[str, Any]


class ForkedRanks:
    """The holder of one group's forked ranks on one node: a Ray actor that forks them and forwards their calls.

    Why one per node and not one per rank: a holder is a Ray worker process, and a Ray worker per
    rank is what forking saves.  The ranks' bundles stay reserved by their placement groups, so
    Ray's resource view is as with a Ray actor per rank; this actor asks for no resources.

    Each rank is known here by a key its route chose (:class:`RankRoute`).  A call carries its
    caller's id and a number per (rank, lane): Ray runs an async actor's calls in any order, so a
    call waits for the caller's earlier ones to be handed to the rank's lane first (every wait
    bounded by :data:`TURN_WAIT_S`), and each lane is one thread.  Arguments travel inside the
    call's :class:`CallHead`, so Ray resolves none of them before the call's turn; the call reads
    its stored arguments itself, sealed values staying sealed (:func:`.warm.pass_sealed_in_this_process`).
    """

    def __init__(self, group_name: str, modules: tuple[str, ...]) -> None:
        pass_sealed_in_this_process()  # what reaches a rank sealed goes on sealed (.warm.seal)
        self._group_name = group_name
        self._modules = modules
        self._keeper = keeper_of(ray.get_runtime_context().get_node_id())
        # The warm process imports while the group's ranks are asked for; the first fork reads the answer.
        self._asked: ray.ObjectRef | None = self._keeper.address.remote(self._modules, sys.path)
        self._place = HostPlace.of_ray_worker()
        self._exec_env = _exec_environment()
        self._forks: dict[str, asyncio.Future] = {}
        # Only the event loop's thread reads and writes these: no lock.
        self._next: dict[tuple[str, str, str], int] = {}  # (caller, key, lane) -> the number whose turn it is
        self._turns = asyncio.Condition()  # notified when a number goes forward and calls wait
        self._waiting = 0
        self._doomed: set[str] = set()  # ranks killed before their fork was done

    async def ping(self) -> int:
        return os.getpid()

    async def fork(self, key: str, rank: int | None, placement_group_id: str, cpus: float, devices: list[Any]) -> None:
        """Fork rank ``key`` (``devices``: one reference to its bundle's devices, or none on a bundle without).

        Its error, if any, is raised by the rank's calls (nobody waits for this one)."""
        forked = self._forked(key)
        try:
            bundle = (await devices[0]) if devices else None
            record = await asyncio.get_running_loop().run_in_executor(
                None, self._fork, rank, placement_group_id, cpus, bundle)
        except Exception as exc:  # noqa: BLE001 - told to the rank's callers
            forked.set_exception(exc)
            forked.exception()  # told through the calls: not an error nobody read
            return
        forked.set_result(record)
        if key in self._doomed:  # killed while it was being forked
            self._kill(record)

    async def call(self, head: CallHead) -> Any:
        """Run host method ``head.name`` on rank ``head.key``, after the caller's calls numbered below ``head.number``."""
        args, kwargs = head.args, head.kwargs
        turn = (head.caller, head.key, head.lane)
        await self._turn(turn, head.number)
        try:
            record = await self._record(head.key)
            if record.gone is not None:
                raise ForkedRankGone(record.gone)
            args = [(await a) if isinstance(a, ray.ObjectRef) else a for a in args]
            kwargs = {k: (await v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
            answer = asyncio.get_running_loop().run_in_executor(record.lanes[head.lane], record.channels[head.lane].call,
                                                                head.name, tuple(args), kwargs)
        finally:
            self._done(turn, head.number)
        return await answer

    async def kill_rank(self, key: str) -> None:
        """Kill rank ``key``'s process (its death then reaches its callers as any death does)."""
        forked = self._forked(key)
        if not forked.done():
            self._doomed.add(key)  # killed the moment its fork is done
        elif forked.exception() is None:
            self._kill(forked.result())

    @staticmethod
    def _kill(record: _ForkedRank) -> None:
        try:
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _forked(self, key: str) -> asyncio.Future:
        """Rank ``key``'s fork: its record once forked (a call may come before its fork does)."""
        if key not in self._forks:
            self._forks[key] = asyncio.get_running_loop().create_future()
        return self._forks[key]

    async def _record(self, key: str) -> _ForkedRank:
        """Rank ``key``, once forked: waits no longer than a warm process's start and a fork."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._forked(key)), WARM_START_S + FORK_START_S)
        except asyncio.TimeoutError:
            raise BackendError(f"{self._group_name}: no fork of rank {key} reached this node's holder within "
                               f"{WARM_START_S + FORK_START_S:g} s") from None

    async def _turn(self, turn: tuple[str, str, str], number: int) -> None:
        if self._next.get(turn, 0) >= number:  # its turn already (the usual case): no wait
            return
        self._waiting += 1
        try:
            async with self._turns:
                await asyncio.wait_for(self._turns.wait_for(lambda: self._next.get(turn, 0) >= number), TURN_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("forked rank %s: call %d of caller %s waited %.0f s for the caller's call %d, which "
                           "never arrived (Ray failed it before it ran); going on without it",
                           turn[1], number, turn[0], TURN_WAIT_S, self._next.get(turn, 0))
        finally:
            self._waiting -= 1

    def _done(self, turn: tuple[str, str, str], number: int) -> None:
        """The call numbered ``number`` was handed to its lane: the caller's next one may go."""
        self._next[turn] = max(self._next.get(turn, 0), number + 1)
        if self._waiting:
            asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._turns:
            self._turns.notify_all()

    def _fork(self, rank: int | None, placement_group_id: str, cpus: float, bundle: BundleDevices | None) -> _ForkedRank:
        """Fork the rank (on a thread: it waits for the rank's host to be built)."""
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in self._exec_env:  # what Ray would set in a worker of the bundle's CPUs
            env["OMP_NUM_THREADS"] = str(max(math.floor(cpus), 1))
        place = dataclasses.replace(self._place, placement_group_id=placement_group_id)
        if bundle is not None:
            place = dataclasses.replace(place, gpu_ids=bundle.gpu_ids, accelerator_ids=bundle.accelerator_ids)
            for name, value in bundle.env.items():
                if value is None:
                    env.pop(name, None)
                else:
                    env[name] = value
        pairs = [socket.socketpair() for _ in range(3)]  # default, control, objects: this end, the rank's end
        request = ForkRequest(rank=rank, group_name=self._group_name, env=env, cwd=os.getcwd(),
                              sys_path=tuple(sys.path), place=place)
        pid = fork_rank(self._warm_address(), request, [end for _, end in pairs], FORK_START_S)
        for _, end in pairs:
            end.close()
        (default, _), (control, _), (objects, _) = pairs
        default.settimeout(FORK_START_S)
        try:
            status, said = receive_message(default)
        except (EOFError, OSError) as exc:
            raise BackendError(f"rank {rank} of {self._group_name}: its forked process {pid} ended before its host "
                               f"was built ({exc}); the warm process's log is in the node's rankmesh-warm-* folder") from None
        if status != "ok":
            raise said
        default.settimeout(None)
        refs = RefTable()
        who = f"rank {rank} of {self._group_name} (forked process {pid})"
        record = _ForkedRank(
            rank, pid, refs,
            channels={DEFAULT_LANE: _Channel(default, refs, scoped=True, who=who),
                      CONTROL_GROUP: _Channel(control, refs, scoped=False, who=who)},
            lanes={lane: ThreadPoolExecutor(1, thread_name_prefix=f"rankmesh-rank-{pid}-{lane}")
                   for lane in (DEFAULT_LANE, CONTROL_GROUP)})
        threading.Thread(target=self._watch, args=(record,), name=f"rankmesh-rank-{pid}-watch", daemon=True).start()
        threading.Thread(target=_serve_objects, args=(objects, refs), name=f"rankmesh-rank-{pid}-objects",
                         daemon=True).start()
        return record

    def _warm_address(self) -> str:
        """The socket of the node's warm process for the group's modules, asked of the keeper at each
        fork: one that died, or whose source files changed, since the last is started again."""
        asked, self._asked = self._asked, None
        try:
            return ray.get(asked or self._keeper.address.remote(self._modules, sys.path), timeout=WARM_START_S)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, BackendError):  # the keeper's refusal, told as it said it
                raise exc.cause from None
            raise

    def _watch(self, record: _ForkedRank) -> None:
        """Tell the rank's death to its callers the moment its process exits."""
        pidfd = os.pidfd_open(record.pid)
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
        logger.debug("forked rank process %d exited", record.pid)  # the group tells it
        record.lost(f"rank {record.rank} of {self._group_name}: its forked process {record.pid} exited")


def _exec_environment() -> dict[str, str]:
    """The environment this process started with, before Ray set anything in it (Linux's ``/proc``)."""
    with open("/proc/self/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _serve_objects(conn: socket.socket, refs: RefTable) -> None:
    """Do a forked rank's ``put``/``get``/``wait_any`` with Ray (:class:`.reshard.RayObjects`), one at a time.

    Neither what the rank puts nor what it fetches is opened here: a put arrives as the rank's
    pickle and is stored sealed, and a sealed value fetched goes on to the rank as it is
    (:func:`.warm.pass_sealed_in_this_process`), so the holder imports nothing for them."""
    objects = RayObjects()
    to_rank = functools.partial(_ToRank, refs=refs)
    with conn:
        while _answer_objects(conn, refs, objects, to_rank):
            pass


def _answer_objects(conn: socket.socket, refs: RefTable, objects: RayObjects, to_rank: Any) -> bool:
    """Answer one request of a rank's objects channel; ``False`` once the rank is gone.

    One request per call, so that nothing it fetched or named outlives its answer here (a
    reference kept by this thread would pin its object, owner-side, until the next request)."""
    step = "a request"
    try:
        step, *args = receive_message(conn, refs.ref)
        if step == "put":
            (numbers,) = args
            answer = ("ok", objects.put(refs.seal(receive_payload(conn), numbers)))
        elif step in ("get", "wait_any"):
            answer = ("ok", getattr(objects, step)(*args))
        else:
            answer = ("error", BackendError(f"a forked rank asked its holder for {step!r}, which is no object step"))
    except (EOFError, OSError):
        return False  # the rank is gone
    except Exception as exc:  # noqa: BLE001 - the rank raises it, as Ray would in a rank of its own
        answer = ("error", sendable(exc))
    try:
        payload = encode_message(answer, to_rank)
    except Exception as exc:  # noqa: BLE001 - a fetched value that does not travel to the rank
        payload = encode_message(("error", BackendError(f"{step}: the value does not travel to a forked rank: "
                                                       f"{exc!r}")), to_rank)
    try:
        send_encoded(conn, payload)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class BundleDevices:
    """The devices Ray gave a bundle, as a worker in it sees them (read by :func:`bundle_devices`)."""

    gpu_ids: tuple[str, ...]
    accelerator_ids: Mapping[str, Any]
    #: Each accelerator's visibility variable (``CUDA_VISIBLE_DEVICES`` ...) as Ray set it (``None``: unset).
    env: Mapping[str, str | None]


def bundle_devices() -> BundleDevices:
    """The devices of the bundle this task runs in: run once per bundle with devices, before its rank is forked."""
    place = HostPlace.of_ray_worker()
    names = {"CUDA_VISIBLE_DEVICES"}
    try:
        from ray._private.accelerators import get_all_accelerator_managers  # noqa: PLC0415 - no public list

        names |= {m.get_visible_accelerator_ids_env_var() for m in get_all_accelerator_managers()} - {None}
    except Exception:  # noqa: BLE001 - a Ray without the list: CUDA's variable alone
        logger.debug("no list of Ray's accelerator variables", exc_info=True)
    return BundleDevices(place.gpu_ids, place.accelerator_ids, {n: os.environ.get(n) for n in sorted(names)})


class _Submitter:
    """This process's calls to forked ranks, numbered per (rank, lane) in the order they were sent.

    Why: Ray runs an async actor's calls in any order; the holder (:class:`ForkedRanks`) puts each
    caller's calls of one rank and lane back in order by these numbers.  One per process, since
    every copy of a route in it is one caller (as every copy of a Ray actor handle is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self.caller = ""
        self._sent: dict[tuple[str, str], int] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def send(self, route: "RankRoute", lane: str, name: str, options: Mapping[str, Any], args: list[Any],
             kwargs: dict[str, Any]) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # a new process (a fork): a new caller
                self._pid, self.caller, self._sent, self._locks = os.getpid(), uuid.uuid4().hex, {}, {}
            turn = (route.key, lane)
            lock = self._locks.setdefault(turn, threading.Lock())
            caller = self.caller
        with lock:
            number = self._sent.get(turn, 0)
            method = route.node.call.options(**options) if options else route.node.call
            ref = method.remote(CallHead(route.key, lane, caller, number, name, args, kwargs))
            self._sent[turn] = number + 1  # not before: a call Ray refused to send takes no number
        return ref


_SUBMITTER = _Submitter()


class _RouteMethod:
    """``route.<method>``: ``.remote(*args, **kwargs)`` and ``.options(...)`` as a Ray actor method has them."""

    def __init__(self, route: "RankRoute", name: str, lane: str, options: Mapping[str, Any]) -> None:
        self._route, self._name, self._lane, self._options = route, name, lane, dict(options)

    def options(self, **options: Any) -> "_RouteMethod":
        return _RouteMethod(self._route, self._name, self._lane, {**self._options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return _SUBMITTER.send(self._route, self._lane, self._name, self._options, list(args), kwargs)


class RankRoute:
    """A forked rank as its callers hold it, in place of a Ray actor handle: its node's holder and its key there.

    ``route.execute.remote(...)`` (and ``.options(num_returns=...)``) runs host method ``execute``
    on the rank through :class:`ForkedRanks`, in order per caller and lane as Ray orders an
    actor's calls; a death of the rank raises :class:`~rankmesh.errors.ForkedRankGone` (one of
    the process deaths of :data:`.waiting.PROCESS_DIED`).  Kill one with :func:`kill_host`."""

    __slots__ = ("node", "key")

    def __init__(self, node: Any, key: str) -> None:
        self.node = node
        self.key = key

    def __getattr__(self, name: str) -> _RouteMethod:
        return _RouteMethod(self, name, lane_of(name), {})  # lane_of: AttributeError for a name the host lacks

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return RankRoute, (self.node, self.key)

    def __repr__(self) -> str:
        return f"RankRoute({self.key})"


def kill_host(handle: Any) -> None:
    """Kill a rank's process now, whichever it is: a Ray actor (no restart) or a forked rank (its route)."""
    if isinstance(handle, RankRoute):
        handle.node.kill_rank.remote(handle.key)
    else:
        ray.kill(handle, no_restart=True)


@functools.lru_cache(maxsize=None)
def holder_actor_class() -> Any:
    """``ray.remote(ForkedRanks)``, asking for no resources (the bundles hold them), made once per process."""
    return ray.remote(num_cpus=0)(ForkedRanks)
