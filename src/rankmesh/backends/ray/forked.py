"""Forked ranks on Ray: the light actor that holds a rank's bundle, and the keeper of each node's warm processes.

Why: a group started with ``process_model="fork"`` forks each rank from its node's warm process
(:mod:`.warm`) instead of importing torch, rankmesh and megatron-core again in a Ray worker per
rank.  Ray still places and accounts: each rank's bundle is held by a :class:`ForkedHost`, a Ray
actor that imports neither torch nor the user's modules, so its process starts in well under a
second (or is one of Ray's prestarted workers).  The rank's process is a child of the warm
process, which Ray does not know of; so:

* **The holder forwards** every host method (:data:`.hostapi.HOST_METHODS`, the call slots) to its
  rank over two Unix socket channels, the default one and the control one, each on the holder's
  thread of the same concurrency group, so calls keep their order and ``stacks``/``ping`` answer
  while a call blocks, as with a rank in its own actor.  A call session's ring needs no holder:
  the rank attaches to the writer's socket itself (:meth:`.host.WorkerHost.open_session`).
* **Death is one death.**  The holder watches its rank's pidfd and exits the moment the rank does,
  so Ray reports the actor dead and every path that handles a dead rank (sessions, recovery,
  spares) sees what it always saw; the rank exits when its holder's channels close.
* **Data through the holder.**  A call's header and the arguments inside it reach the rank as the
  bytes they are; the rank's answer goes back sealed (:class:`.warm.Sealed`: its pickle, opened
  where Ray unpickles it, not in the holder).  Arguments in Ray's store (over 100 KiB, off the
  caller's node or on Ray's tasks; a future passed along) are stored sealed by the caller
  (:func:`.warm.seal`): this process is a holder (:func:`.warm.pass_sealed_in_this_process`), so
  Ray hands them over unopened and the rank opens them; a future's parts the rank then fetches
  through its holder.  The call session (blocking calls on the node, large arguments in memory
  files included) never goes through it; Ray's tasks (non-blocking calls, futures passed along,
  node agents' data calls) do.
* **Ray's objects stay in the holder.**  An ObjectRef on its way to the rank (in a call's
  arguments, or in a value the rank fetched) is kept in the holder's :class:`RefTable`, and the
  rank gets a :class:`.warm.RefToken` for it; a token in the rank's answer turns back into the
  reference.  The rank's object transport (reshard's ``put``/``get``/``wait_any``,
  :class:`.warm.HolderObjects`) asks the holder on a third channel, served by a thread of the
  holder's own (:meth:`ForkedHost._serve_objects`).  The references a call brought or put are let
  go when that call answers (those in its answer live on in Ray's, as a Ray actor's would).

A :class:`WarmKeeper` per node (a detached named actor in rankmesh's namespace, ``num_cpus=0``)
starts the node's warm processes, one per import set and ``sys.path``, and restarts one that
died or whose source files changed on disk since it imported them.  A warm process unused for
:data:`.warm.IDLE_S` exits by itself, so a long-lived cluster does not keep megatron-core
imported for a driver long gone.  What a forked rank cannot do is
listed in ``docs/ray_backend.md`` ("Process models").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray

from rankmesh.errors import BackendError, RayHandleInChannel

from .hostapi import ANSWER_PARTS, BARE_SLOT_METHODS, CONTROL_GROUP, HOST_METHODS, SLOT_METHODS, HostPlace
from .reshard import RayObjects
from .runtime import DETACHED_NAMESPACE
from .warm import (ForkRequest, NoHandles, Sealed, encode_message, fork_rank, pass_sealed_in_this_process, receive_message,
                   receive_payload, send_encoded, sendable)

logger = logging.getLogger(__name__)

#: The process models a group may choose: one Ray actor per rank, or ranks forked from a warm process.
PROCESS_MODELS: tuple[str, ...] = ("ray", "fork")
#: How long a warm process may take to import its modules (seconds).
WARM_START_S = 300.0
#: How long a forked rank may take to build its host and say so (seconds).
FORK_START_S = 120.0
#: Ray's switch for its automatic ``ray.init()`` on first use, set off for warm processes.
NO_AUTO_CONNECT = ("RAY_ENABLE_AUTO_CONNECT", "0")
#: The keeper actor's name, per node.
KEEPER_NAME = "rankmesh_warm_keeper_{node_id}"


#: The environment variable that sets the process model of groups that do not choose one.
PROCESS_MODEL_ENV = "RANKMESH_PROCESS_MODEL"


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
    """One node's warm processes, by import set: started on first need, replaced when dead or stale."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rankmesh-warm-")
        self._started = 0
        #: (modules, sys.path) -> the warm process, its socket, the source files it read.
        self._warm: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[subprocess.Popen, str, list[tuple[str, int, int]]]] = {}

    def address(self, modules: Sequence[str], sys_path: Sequence[str]) -> str:
        """The socket of the warm process that imported ``modules`` on ``sys_path`` (the ranks'),
        started (and waited for) if need be."""
        key = (tuple(sorted(set(modules))), tuple(sys_path))
        found = self._warm.get(key)
        if found is not None:
            process, address, files = found
            why = "it exited" if process.poll() is not None else "a source file changed" if _changed(files) else None
            if why is None:
                return address
            process.kill()
            process.wait()
            logger.info("warm process %d for %s retired (%s)", process.pid, key[0], why)
        self._warm[key] = self._start(key)
        return self._warm[key][1]

    def processes(self) -> list[tuple[tuple[str, ...], int]]:
        """(modules, pid) of each live warm process (for tests and tools)."""
        return [(key[0], p.pid) for key, (p, _, _) in self._warm.items() if p.poll() is None]

    def _start(self, key: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[subprocess.Popen, str, list[tuple[str, int, int]]]:
        modules, sys_path = key
        self._started += 1
        address = os.path.join(self._dir, f"warm-{self._started}.sock")
        log = os.path.join(self._dir, f"warm-{self._started}.log")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each rank sets its own
        # Ray read in a forked rank must not connect it as a hidden driver of its own (it has no
        # Ray worker): Ray's automatic ray.init() is off for the warm process and its forks.
        env[NO_AUTO_CONNECT[0]] = NO_AUTO_CONNECT[1]
        with open(log, "wb") as err:
            process = subprocess.Popen([sys.executable, "-m", "rankmesh.backends.ray.warm", address, json.dumps(sys_path),
                                        *modules],
                                       stdout=subprocess.PIPE, stderr=err, env=env)
        ready, _, _ = select.select([process.stdout], [], [], WARM_START_S)
        line = process.stdout.readline() if ready else b""
        if not line:
            process.kill()
            process.wait()
            with open(log, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise BackendError(f"the warm process for {list(modules)} did not start within {WARM_START_S:g} s "
                               f"(exit code {process.returncode}); its log ends:\n{tail}")
        said = json.loads(line)
        for name, error in said["failed"].items():
            logger.warning("the warm process for %s could not import %s: %s (each rank will import it)", modules, name, error)
        return process, address, [tuple(f) for f in said["files"]]


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
    """How a group's ranks are forked: the modules its warm processes import."""

    modules: tuple[str, ...]

    @classmethod
    def of_roles(cls, roles: Mapping[str | None, Any], preload: Sequence[str]) -> "Forking":
        """The worker classes' modules (a class defined in ``__main__`` travels by value) and ``preload``."""
        modules = {getattr(role.cls, "__module__", None) for role in roles.values()} | set(preload)
        return cls(tuple(sorted(m for m in modules if m and m != "__main__")))

    def start(self, rank: int | None, group_name: str, options: Mapping[str, Any]) -> Any:
        """A holder of ``rank`` with Ray ``options`` (its bundle and resources), forking its rank where Ray places it."""
        return holder_actor_class().options(**options).remote(rank, group_name, self.modules)


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
    (the default channel's calls; control calls carry none)."""

    def __init__(self, conn: socket.socket, refs: RefTable, scoped: bool) -> None:
        self.conn = conn
        self.refs = refs
        self.scoped = scoped

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
        except (EOFError, OSError):
            os._exit(1)  # the rank is gone under this call: the holder goes too, and Ray reports the actor dead
        if status == "error":
            raise said
        # Passed on unopened: whoever reads them from Ray rebuilds the values, and this holder imports nothing for them.
        parts = tuple(self.refs.seal(payload, numbers) for payload, numbers in zip(payloads, said))
        return parts if name in ANSWER_PARTS else parts[0]


class ForkedHost:
    """The holder of a forked rank's bundle: a Ray actor that forwards host calls to the rank (see the module docstring)."""

    def __init__(self, rank: int | None, group_name: str, modules: tuple[str, ...]) -> None:
        pass_sealed_in_this_process()  # what reaches the rank sealed goes on sealed (.warm.seal)
        # The keeper of the node Ray placed this holder on (a bundle re-placed after its node died
        # lands elsewhere than its slot first said).
        keeper = keeper_of(ray.get_runtime_context().get_node_id())
        address = ray.get(keeper.address.remote(modules, sys.path), timeout=WARM_START_S + FORK_START_S)
        pairs = [socket.socketpair() for _ in range(3)]  # default, control, objects: holder's end, rank's end
        request = ForkRequest(rank=rank, group_name=group_name, env=dict(os.environ), cwd=os.getcwd(),
                              sys_path=tuple(sys.path), place=HostPlace.of_ray_worker())
        self._pid = fork_rank(address, request, [end for _, end in pairs], FORK_START_S)
        for _, end in pairs:
            end.close()
        (default, _), (control, _), (objects, _) = pairs
        default.settimeout(FORK_START_S)
        try:
            status, said = receive_message(default)
        except (EOFError, OSError) as exc:
            raise BackendError(f"rank {rank} of {group_name}: its forked process {self._pid} ended before its host "
                               f"was built ({exc}); the warm process's log is in the node's rankmesh-warm-* folder") from None
        if status != "ok":
            raise said
        default.settimeout(None)
        self._refs = RefTable()
        self._default = _Channel(default, self._refs, scoped=True)
        self._control = _Channel(control, self._refs, scoped=False)
        self._pidfd = os.pidfd_open(self._pid)
        threading.Thread(target=self._watch, name="rankmesh-rank-watch", daemon=True).start()
        threading.Thread(target=self._serve_objects, args=(objects,), name="rankmesh-rank-objects", daemon=True).start()

    def _serve_objects(self, conn: socket.socket) -> None:
        """Do the rank's ``put``/``get``/``wait_any`` with Ray (:class:`.reshard.RayObjects`), one at a time.

        Neither what the rank puts nor what it fetches is opened here: a put arrives as the rank's
        pickle and is stored sealed, and a sealed value fetched goes on to the rank as it is
        (:func:`.warm.pass_sealed_in_this_process`), so the holder imports nothing for them."""
        objects = RayObjects()
        to_rank = functools.partial(_ToRank, refs=self._refs)
        while self._answer_objects(conn, objects, to_rank):
            pass

    def _answer_objects(self, conn: socket.socket, objects: RayObjects, to_rank: Any) -> bool:
        """Answer one request of the rank's objects channel; ``False`` once the rank is gone.

        One request per call, so that nothing it fetched or named outlives its answer here (a
        reference kept by this thread would pin its object, owner-side, until the next request)."""
        step = "a request"
        try:
            step, *args = receive_message(conn, self._refs.ref)
            if step == "put":
                (numbers,) = args
                answer = ("ok", objects.put(self._refs.seal(receive_payload(conn), numbers)))
            elif step in ("get", "wait_any"):
                answer = ("ok", getattr(objects, step)(*args))
            else:
                answer = ("error", BackendError(f"a forked rank asked its holder for {step!r}, which is no object step"))
        except (EOFError, OSError):
            return False  # the rank is gone (the watch ends this process)
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

    def _watch(self) -> None:
        """Exit the moment the rank does, so Ray reports this actor (the rank, to everyone else) dead."""
        select.select([self._pidfd], [], [])
        logger.debug("forked rank process %d exited; its holder exits too", self._pid)  # the group tells it
        time.sleep(0.05)  # let a call the rank answered just before leave first
        os._exit(1)


def _forward(name: str, group: str | None) -> Any:
    if group is None:
        def method(self: ForkedHost, *args: Any, **kwargs: Any) -> Any:
            return self._default.call(name, args, kwargs)
    else:
        @ray.method(concurrency_group=group)
        def method(self: ForkedHost, *args: Any, **kwargs: Any) -> Any:
            return self._control.call(name, args, kwargs)
    method.__name__ = method.__qualname__ = name
    return method


def _forward_bare(name: str) -> Any:
    def bare(self: ForkedHost) -> Any:  # no parameters: Ray skips binding arguments (see .hostapi)
        return self._default.call(name, (), {})
    bare.__name__ = bare.__qualname__ = name
    return bare


for _name, _group in HOST_METHODS.items():
    setattr(ForkedHost, _name, _forward(_name, _group))
for _name in SLOT_METHODS:
    setattr(ForkedHost, _name, _forward(_name, None))
for _name in BARE_SLOT_METHODS:
    setattr(ForkedHost, _name, _forward_bare(_name))


@functools.lru_cache(maxsize=None)
def holder_actor_class() -> Any:
    """``ray.remote(ForkedHost)`` with the control thread a rank's host has, made once per process."""
    return ray.remote(concurrency_groups={CONTROL_GROUP: 1})(ForkedHost)
