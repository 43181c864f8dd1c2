"""The worker-process side of the Ray backend: the generic host actor of one rank.

Why one generic actor instead of ``ray.remote(UserClass)``: the host sets the rank's environment
and builds the user's class inside :func:`rankmesh.worker.construct`, so ``self.rank``/``self.mesh``
work in ``__init__``; it can host several colocated roles in one process; and every call goes
through :func:`rankmesh.worker.invoke`, the same worker-side path as the in-process backend, so
errors and output dropping behave identically.

Creation takes three steps so that MASTER_PORT is known before any user code runs:
``WorkerHost(rank)`` (cheap), rank 0's :meth:`WorkerHost.reserve_master_port`, then
:meth:`WorkerHost.setup` on every rank with the full environment.  The controller drives these
steps from :mod:`.hosts`; this module is what every worker process imports.

Calls run one at a time: on the actor's default thread (a Ray task, in submission order) or on
the session thread (a call session's ring, :mod:`.serve`), under **one lock** for everything that
touches the workers or torch.distributed.  The host's own steps (building workers, leaving and
re-joining torch.distributed, restoring from a peer, tearing down: :data:`STEPS`) are calls like
any other (a header whose ``step`` is set, :mod:`.wire`), so recovery queues behind a call a
survivor still runs instead of tearing its process groups down under it.  Which carrier's call
runs first is the controller's to decide (:mod:`.order`): the host keeps no count of calls.
:meth:`WorkerHost.stacks`, :meth:`~WorkerHost.ping` and the session's own methods run in a second
concurrency group (``control``, one thread), so they answer while a call blocks: that is how a
hang is localized (:mod:`rankmesh.hangs`) and a busy rank told from a dead one.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import sys
import threading
import time
from collections import deque
from typing import Any, Mapping

import ray

from rankmesh.backend import ObjectTransport
from rankmesh.errors import BackendError
from rankmesh.hangs import ProcessStacks, capture_process
from rankmesh.sharedmem import register_store_processes
from rankmesh.devices import unify_visible_devices
from rankmesh.tracing.marks import FETCH_MARK, KEEP_MAX, timed_call
from rankmesh.worker import FUSED_ROLES_ATTR, WorkerContext, construct, invoke, move

from .rejoin import exit_on_call, leave, load_recovery_states, recovery_states, rejoin, restore, sever
from rankmesh.rendezvous import GLOO_IFNAME, interface_of, reserve_port
from .reshard import RayObjects
from .files import FilePool, refused
from .files import forget as forget_files
from .serve import SessionState, connect, start_serving, writer_may_open
from .hostapi import BARE_SLOT_METHODS, CONTROL_GROUP, SLOT_METHODS, HostPlace, HostSetup, RoleInit, role_class
from .wire import CallHeader, decode_call, fill_call

logger = logging.getLogger(__name__)

#: The host's own steps a call may name (``CallHeader.step``): lifecycle and recovery, run under
#: the host's lock like worker calls.  ``describe`` and ``ping`` are not steps: they must answer
#: while a call runs (the control thread).
STEPS: frozenset[str] = frozenset({
    "node_info", "reserve_master_port", "setup", "warm", "teardown", "clock", "leave_distributed",
    "rejoin_distributed", "restore_from_peer", "recovery_state", "load_recovery_state", "exit_on_next_call",
})


def host_actor_options() -> dict[str, Any]:
    """``ray.remote`` options every WorkerHost actor class is made with (before ``.options``).

    A fresh dict per call: Ray adds its own system groups to the ``concurrency_groups`` it is given.
    """
    return {"concurrency_groups": {CONTROL_GROUP: 1}}


class WorkerHost:
    """Ray actor body; wrapped with ``ray.remote`` by :func:`.hosts.launch_hosts` (options differ per group)."""

    def __init__(self, rank: int | None, group_name: str, place: HostPlace | None = None,
                 objects: ObjectTransport | None = None) -> None:
        """``rank`` is ``None`` for a warm spare (:mod:`.spares`): it gets one when :meth:`setup` makes it a rank.

        ``place`` and ``objects`` are a forked rank's (:mod:`.warm`): by default the host asks Ray
        where it runs and moves reshard's objects through Ray's store (:class:`.reshard.RayObjects`)."""
        self._started_ns = time.time_ns()  # start-up report: the process is up, rankmesh imported
        self._place = place if place is not None else HostPlace.of_ray_worker()
        self._rank = rank
        self._group_name = group_name
        self._setup: HostSetup | None = None
        self._workers: dict[str | None, Any] = {}
        self._master: tuple[str, int] | None = None
        self._env_before: dict[str, str | None] = {}
        self._call_thread: int | None = None  # the thread running a call now, for stacks()
        # Timings of traced non-blocking calls ([key, *RankTiming]), until the controller drains them.
        self._kept: deque[list[int]] = deque(maxlen=KEEP_MAX)
        self._left_backend: str | None = None  # the default group's backend, between leave and rejoin
        self._slots: dict[int, bytes] = {}  # call slot -> installed header (see wire.HeaderCache)
        self._decoded: dict[int, CallHeader] = {}  # call slot -> its header, decoded once
        # Inputs received here map copy-on-write through the node raylet's fd of the object store.
        raylet = self._place.raylet_pid
        register_store_processes([] if raylet is None else [raylet])
        # The process's object transport, shared by its roles (reshard).
        self._objects = objects if objects is not None else RayObjects()
        self._classes: dict[str | None, type] = {}  # each role's class, loaded at setup
        self._lock = threading.Lock()  # one call or step at a time, from Ray's thread or the session's
        self._session: tuple[Any, Any] | None = None  # the open call session's (ring, reply ring)
        self._session_state = SessionState()  # its parked outputs and the last call it read
        self._device_index: int | None = None  # the CUDA device calls run on (set on every calling thread)
        self._thread_state = threading.local()

    # ----- creation ----------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        """Where this process runs, as Ray sees it (checked against the pool by the group)."""
        place = self._place
        return {
            "rank": self._rank,
            "node_id": place.node_id,
            "node_ip": place.node_ip,
            "pid": os.getpid(),
            "ray_pid": place.ray_pid,
            "placement_group_id": place.placement_group_id,
            "gpu_ids": list(place.gpu_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "started_ns": self._started_ns,
        }

    def reserve_master_port(self, fresh: bool = False) -> tuple[str, int]:
        """Rank 0 only: keep a socket bound on this node and publish (MASTER_ADDR, MASTER_PORT).

        ``fresh=True`` reserves a new port (re-forming the group after a replacement)."""
        if self._master is None or fresh:
            addr = self._place.node_ip
            self._master = (addr, reserve_port(addr))
        return self._master

    def setup(self, setup: HostSetup) -> tuple[int, int]:
        """Set the environment, then build every role inside the rank's worker context.

        Returns when it began (the worker classes were imported to unpickle ``setup``) and
        ended, on this process's clock, for the start-up report.
        """
        if self._setup is not None:
            raise BackendError(f"rank {self._rank} of {self._group_name} is already set up")
        for name in setup.preload:  # counted with the worker classes' imports in the start-up report
            importlib.import_module(name)
        classes = {role: role_class(spec) for role, spec in setup.roles.items()}
        imported_ns = time.time_ns()
        self._rank = setup.rank  # a spare becomes the rank it replaces
        self._env_before = {k: os.environ.get(k) for k in setup.env}
        os.environ.update({k: str(v) for k, v in setup.env.items()})
        self._unify_devices()
        self._bind_gloo(self._place.node_ip)
        for role, spec in setup.roles.items():
            self._workers[role] = construct(classes[role], self._context(setup, role), tuple(spec.args), dict(spec.kwargs))
        self._classes = classes
        self._record_device()
        self._setup = setup
        return imported_ns, time.time_ns()

    def _context(self, setup: HostSetup, role: str | None) -> WorkerContext:
        """Where ``role``'s worker stands in the group, as ``setup`` says."""
        return WorkerContext(
            rank=setup.rank,
            world_size=setup.world_size,
            mesh=setup.mesh,
            meshes=dict(setup.meshes),
            local_rank=setup.local_rank,
            local_world_size=setup.local_world_size,
            node=self._place.node_ip,
            role=role,
            objects=self._objects,
        )

    def _unify_devices(self) -> None:
        """CUDA_VISIBLE_DEVICES as the one visibility variable (see :mod:`rankmesh.devices`)."""
        ids = self._place.accelerator_ids
        change = unify_visible_devices(os.environ, ids)
        for key in (*change.set, *change.unset):
            self._env_before.setdefault(key, os.environ.get(key))
        for key in change.unset:
            os.environ.pop(key, None)
        os.environ.update(change.set)
        if change.device_index is not None:
            import torch  # deferred: only a process with accelerators gets here

            torch.cuda.set_device(change.device_index)
            self._device_index = change.device_index

    def _bind_gloo(self, address: str) -> None:
        """Gloo's devices bind the interface of the rank's node address (:func:`rankmesh.rendezvous.interface_of`),
        unless the user chose one (``GLOO_SOCKET_IFNAME`` in the environment or ``worker_env``)."""
        if GLOO_IFNAME in os.environ:
            return
        name = interface_of(address)
        if name is not None:
            self._env_before.setdefault(GLOO_IFNAME, None)
            os.environ[GLOO_IFNAME] = name

    def _record_device(self) -> None:
        """The CUDA device the roles selected while being built, for the session thread to select too.

        CUDA's current device is per thread: a worker that calls ``torch.cuda.set_device`` in its
        ``__init__`` (``MegatronWorker`` does, by LOCAL_RANK, when a process sees several GPUs)
        selects it for Ray's thread only, and calls on the session thread would run on device 0.
        A process that never started CUDA records nothing (reading the device would start it).
        """
        torch = sys.modules.get("torch")
        if self._device_index is None and torch is not None and torch.cuda.is_initialized():
            self._device_index = torch.cuda.current_device()

    def warm(self, roles: Mapping[str | None, RoleInit]) -> dict[str, Any]:
        """A spare's start: import what a rank of its group would, then wait to become one.

        Torch came with this module (:mod:`.rejoin`); receiving ``roles`` imports the worker
        classes' modules (megatron-core, the user's); tensordict is imported too, which a rank's first DataProto would import.
        Nothing is built: the rank, its environment and its workers come with :meth:`setup`.
        Returns :meth:`node_info` with ``warm_ns``, when the imports ended.
        """
        from rankmesh.data.tensordicts import module as tensordict_module  # deferred: only spares pay it here

        tensordict_module()
        for spec in roles.values():
            role_class(spec)
        return {**self.node_info(), "roles": sorted(map(str, roles)), "warm_ns": time.time_ns()}

    def teardown(self) -> None:
        """Drop the role objects and restore the environment, so :meth:`setup` may run again.

        Process-wide state the workers created (an initialized torch.distributed, module
        globals) stays: this exists to reuse processes in tests, not to isolate workloads.
        """
        self._workers.clear()
        self._classes = {}
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._setup = None

    # ----- calls -------------------------------------------------------------------------------

    def _worker(self, role: str | None) -> Any:
        """The worker object of ``role`` (``None``: the process's only worker)."""
        if role in self._workers:
            return self._workers[role]
        if len(self._workers) == 1:
            only = next(iter(self._workers.values()))
            if role is None:
                return only
            fused = getattr(only, FUSED_ROLES_ATTR, None)  # verl's fused worker holds its roles
            if isinstance(fused, dict) and role in fused:
                return fused[role]
        raise BackendError(
            f"rank {self._rank} of {self._group_name} hosts roles {sorted(map(str, self._workers))}; "
            f"a call for role {role!r} names none of them (call a role's group from wg.spawn(...))"
        )

    def execute(self, header: bytes, *shared: Any, enter_ns: int = 0, keep: int = 0) -> Any:
        """Run one call (see :mod:`.wire` for ``header`` and ``shared``) through :func:`rankmesh.worker.invoke`.

        ``shared`` are the values of the call's shared objects, fetched by Ray before the call
        starts and already rebuilt by the data layer as this rank's private (copy-on-write) data.  A traced
        call comes through :meth:`execute_traced` (``enter_ns``), so an untraced one reads no clock.
        """
        return self._run(decode_call(header, shared), shared, enter_ns, keep)

    def execute_after(self, after: int, timeout_s: float | None, keep: int, trace: bool, header: bytes, *shared: Any) -> Any:
        """:meth:`execute`, once the call session's call ``after`` (and every earlier one) has finished here.

        A Ray task the controller sent after session calls to this rank (a data call after a
        call the caller gave up, say) comes this way, so the rank runs its calls in the order they
        were sent whichever carrier took each; the wait ends at ``timeout_s`` (the call's deadline)
        with an error naming the session call still running, or when the session ends (calls it
        had not read never run).
        """
        enter_ns = time.time_ns() if trace else 0
        state = self._session_state
        if not state.wait_done(after, timeout_s):
            raise BackendError(
                f"rank {self._rank} of {self._group_name}: waited {timeout_s:g} s for the call session's call {after} "
                f"(sent before this one) to end, and it still runs (call {state.call_id} is the last this rank read)")
        return self.execute(header, *shared, enter_ns=enter_ns, keep=keep)

    def execute_for(self, call_id: int, after: int, timeout_s: float | None, header: bytes, *shared: Any) -> tuple[bool, Any]:
        """A call a node agent sent as a Ray task (a data call: its pieces come as ``shared``, fetched
        by Ray from this node's store): :meth:`execute_after` ``after``, and once it ended the
        session counts call ``call_id`` finished (a Ray task the controller sends after it waits
        for that).  Returns ``(whether there is an output, the output)``, two objects: the agent
        reads the flag and hands the controller the output's reference, never its bytes.
        """
        try:
            if after:
                output = self.execute_after(after, timeout_s, 0, False, header, *shared)
            else:
                output = self.execute(header, *shared)
            return output is not None, output
        finally:
            self._session_state.finished(call_id)

    def fence(self) -> None:
        """Nothing: it returns once every Ray task sent before it has (the controller's order, :mod:`.order`)."""

    def _run(self, call: CallHeader, shared: tuple[Any, ...], enter_ns: int = 0, keep: int = 0) -> Any:
        with self._lock:
            return self._run_now(call, shared, enter_ns, keep)

    def _run_now(self, call: CallHeader, shared: tuple[Any, ...], enter_ns: int, keep: int) -> Any:
        self._call_thread = threading.get_ident()
        try:
            if call.step:
                return self._step(call)
            worker = self._worker(call.role)
            if call.trace:  # a traced call: the output travels back with this rank's timing
                traced = timed_call(
                    invoke, worker, call.method, call.args, call.kwargs,
                    enter_ns=enter_ns, inputs=(call.args, call.kwargs), return_output=call.return_output, receive=call.receive,
                )
                if call.fetch_mark:  # the call's first rank: the controller notes when it unpickles this
                    traced.insert(0, FETCH_MARK)
                if keep:  # non-blocking: the output goes into a future, the timing waits here
                    self._kept.append([keep, *traced[1:]])
                    return traced[0]
                if self._kept:  # hand over what was kept, with this output (no extra round)
                    traced.append(self._take_kept())
                return traced
            return invoke(
                worker, call.method, call.args, call.kwargs, return_output=call.return_output, receive=call.receive
            )
        finally:
            self._call_thread = None

    def _step(self, call: CallHeader) -> Any:
        """A host step (:data:`STEPS`), under the lock like a worker call."""
        if call.method not in STEPS:
            raise BackendError(f"rank {self._rank} of {self._group_name}: no host step {call.method!r} (steps: {sorted(STEPS)})")
        return getattr(self, call.method)(*call.args, **call.kwargs)

    def execute_install(self, slot: int, header: bytes, *shared: Any) -> Any:
        """:meth:`execute`, keeping ``header`` as call slot ``slot``: later calls come as ``call_<slot>(*shared)``."""
        enter_ns = time.time_ns()  # used only if the header is a traced call's (once per slot and host)
        self._slots[slot] = header
        self._decoded.pop(slot, None)
        return self.execute(header, *shared, enter_ns=enter_ns)

    def _run_slot(self, slot: int, shared: tuple[Any, ...]) -> Any:
        """The body of ``call_<slot>``: :meth:`execute` with the header installed as ``slot``.

        A traced header (every rank of a traced blocking call but the first, which carries the
        fetch mark) reads the clock on arrival, as :meth:`execute_traced` does.
        """
        return self._run_installed(slot, shared)

    def _run_installed(self, slot: int, shared: tuple[Any, ...]) -> Any:
        call = self._decoded.get(slot)
        if call is not None:
            return self._run(fill_call(call, shared), shared, time.time_ns() if call.trace else 0)
        header = self._slots.get(slot)
        if header is None:  # only if Ray reordered tasks or restarted the process: refuse, never guess
            raise BackendError(
                f"rank {self._rank} of {self._group_name}: call slot {slot} was never installed in this process "
                "(was it restarted by Ray? rankmesh groups do not support max_restarts)"
            )
        enter_ns = time.time_ns()
        call = self._decoded[slot] = pickle.loads(header)  # a failure here repeats on the next call
        return self._run(fill_call(call, shared), shared, enter_ns if call.trace else 0)

    # ----- call sessions (.session) ---------------------------------------------------------

    @ray.method(concurrency_group=CONTROL_GROUP)
    def open_session(self, address: str, reader: int, probe: bytes | None = None) -> tuple[str | None, str | None]:
        """Join the writer's call session at Unix socket ``address`` as ``reader``.

        Runs on the control thread (a running call does not hold it up).  A session opened
        before is given up first: its ring is aborted, which ends its thread.  ``probe``: a
        pickled :class:`.files.Mapped` of the writer's.  Returns why this host cannot open the
        writer's files (then the writer sends large arguments through the store) or ``None``,
        and the token of the pool its large outputs go to for the writer to map (``None``: the
        writer may not open this process's files, so they are parked for ``take_parked``).
        """
        self.close_session()
        ring, reply = connect(address, reader)
        self._session = (ring, reply)
        self._session_state = state = SessionState()
        files = FilePool() if writer_may_open(ring.peer_pids()) else None
        start_serving(ring, reply, self._session_call, state, lambda: self._rank, files)
        return (None if probe is None else refused(probe)), (None if files is None else files.token)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def close_session(self) -> None:
        """Give up the open call session, if any (its thread ends; what it parked goes)."""
        if self._session is not None:
            ring, _ = self._session
            ring.abort()  # a no-op if the session thread ended on its own and closed it
            self._session = None
        self._session_state.clear()
        self._session_state.end()
        forget_files()  # the writer's pool closes the files this process kept mapped

    def _session_call(self, call: CallHeader, seq: int, enter_ns: int) -> Any:
        """Run a call that came through the session (on the session thread, under the host's lock)."""
        if self._device_index is not None and not getattr(self._thread_state, "device_set", False):
            import torch  # deferred: only a process with accelerators gets here

            torch.cuda.set_device(self._device_index)  # CUDA's current device is per thread
            self._thread_state.device_set = True
        return self._run(call, (), enter_ns if call.trace else 0)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def take_parked(self, call_id: int) -> Any:
        """A session call's output that was too big for the reply ring (through the object store)."""
        return self._session_state.take(call_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def parked_outputs(self) -> int:
        """How many session outputs this process still keeps for :meth:`take_parked` (each is let go
        once taken, or when its call is given up): a leak shows here."""
        return self._session_state.parked

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stacks(self) -> ProcessStacks:
        """Every thread's stack now, the running call's first, with the collective it waits in.

        Runs on the control thread, so it answers while :meth:`execute` blocks (see
        :func:`rankmesh.hangs.capture_process`).
        """
        return capture_process(self._call_thread, None if self._setup is None else self._setup.mesh)

    def execute_traced(self, header: bytes, *shared: Any) -> Any:
        """:meth:`execute` of a traced call: the clock is read on arrival, before the call is decoded."""
        return self.execute(header, *shared, enter_ns=time.time_ns())

    def execute_kept(self, key: int, header: bytes, *shared: Any) -> Any:
        """:meth:`execute_traced` of a non-blocking call: the output alone goes back, the timing is kept under ``key``."""
        return self.execute(header, *shared, enter_ns=time.time_ns(), keep=key)

    def _take_kept(self) -> list[list[int]]:
        taken = []
        try:
            while True:  # popleft is atomic: drain_timings may run on the control thread meanwhile
                taken.append(self._kept.popleft())
        except IndexError:
            return taken

    @ray.method(concurrency_group=CONTROL_GROUP)
    def drain_timings(self) -> tuple[int, list[list[int]]]:
        """``(this process's clock, the kept timings)``; runs beside a running call (control thread)."""
        return time.time_ns(), self._take_kept()


    # ----- introspection (attaching to detached groups, tests) ---------------------------------

    @ray.method(concurrency_group=CONTROL_GROUP)
    def describe(self) -> dict[str, Any]:
        """What another driver needs to attach: rank, world size, mesh, roles, placement."""
        info = self.node_info()
        s = self._setup
        if s is not None:
            info.update(
                world_size=s.world_size,
                local_rank=s.local_rank,
                local_world_size=s.local_world_size,
                node_index=s.node_index,
                mesh=s.mesh,
                meshes=dict(s.meshes),
                roles={role: f"{cls.__module__}.{cls.__qualname__}" for role, cls in self._classes.items()},
                role_classes=dict(self._classes),
                group_name=s.group_name,
            )
        return info

    @ray.method(concurrency_group=CONTROL_GROUP)
    def sever(self, addresses: list[str]) -> int:
        """Shut down this process's connections to nodes declared dead (:func:`.rejoin.sever`).

        Runs on the control thread, beside a call blocked in a collective with a rank there,
        which then fails at once instead of at gloo's timeout."""
        return sever(addresses)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int | None:
        """This rank (``None`` for a spare): answers at once, even while a call runs (a liveness probe)."""
        return self._rank

    def clock(self) -> int:
        """This process's clock (``time.time_ns``), for measuring its offset from the controller's."""
        return time.time_ns()

    # ----- recovery (driven by .recovery when dead ranks are replaced; see .rejoin) ------------

    def leave_distributed(self) -> None:
        """A survivor: every role drops its process groups, then the default group is destroyed."""
        self._left_backend = leave(self._workers)

    def rejoin_distributed(self, env: Mapping[str, str], setup: HostSetup | None = None) -> None:
        """A survivor: take the new rendezvous variables, re-form the default group, rebuild the roles' groups.

        ``setup``: the rank's new place when its group shrank or grew (:mod:`.remesh`): rank,
        world size, mesh and environment change, the workers and their state stay.
        """
        if setup is not None:
            os.environ.update(setup.env)
            for role, worker in self._workers.items():
                move(worker, self._context(setup, role))
            self._setup, self._rank = setup, setup.rank
        os.environ.update(env)
        rejoin(self._workers, self._left_backend)

    def restore_from_peer(self, peer_rank: int, sending: bool) -> None:
        """Every role's ``restore_from_peer`` (the new rank receives, its live dp peer sends)."""
        restore(self._workers, peer_rank, sending)

    def recovery_state(self) -> dict[Any, Any]:
        """Every role's state for a replaced rank, through the object store (this is its live peer)."""
        return recovery_states(self._workers)

    def load_recovery_state(self, states: Mapping[Any, Any]) -> None:
        """A replaced rank: every role takes its peer's :meth:`recovery_state`."""
        load_recovery_states(self._workers, states)

    def exit_on_next_call(self, role: str | None, method: str) -> int:
        """Fault injection for drills and the demo: die on entering the next ``method`` call; returns the pid."""
        exit_on_call(self._worker(role), method)
        return os.getpid()


def _slot_method(slot: int) -> Any:
    def call(self: WorkerHost, *shared: Any) -> Any:
        return self._run_slot(slot, shared)

    call.__name__ = call.__qualname__ = SLOT_METHODS[slot]
    call.__doc__ = f"Run the call whose header is installed as slot {slot} (:meth:`WorkerHost.execute_install`)."
    return call


def _bare_slot_method(slot: int) -> Any:
    def bare(self: WorkerHost) -> Any:
        return self._run_slot(slot, ())

    bare.__name__ = bare.__qualname__ = BARE_SLOT_METHODS[slot]
    bare.__doc__ = f"Run the call installed as slot {slot}, which has no shared values (a method without parameters)."
    return bare


# call_0 ... call_{CALL_SLOTS-1} and bare_0 ...: a task without a header argument (see wire.HeaderCache).
for _slot in range(len(SLOT_METHODS)):
    setattr(WorkerHost, SLOT_METHODS[_slot], _slot_method(_slot))
    setattr(WorkerHost, BARE_SLOT_METHODS[_slot], _bare_slot_method(_slot))
del _slot
