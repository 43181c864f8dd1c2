"""The warm processes of one node, a base per ``sys.path`` and one per import set forked from it, and the ranks they fork.

Why: every rank in its own Ray worker is a fresh interpreter that imports torch (2.7 CPU-s here),
rankmesh and megatron-core (6.7 CPU-s for a megatron rank) before it does anything.  A warm
process imports a group's worker modules once per node; a rank is then a ``fork`` of it, ready
in milliseconds, its imports already done (``docs/ray_backend.md``, "Process models").

**The warm processes.**  A node's keeper (:class:`.forked.WarmKeeper`) starts one *base* warm
process per ``sys.path`` (``python -m rankmesh.backends.ray.warm SOCKET SYS_PATH``), which imports
the rank's host (torch, rankmesh) and nothing else, says it is ready on stdout and which source
files it read (a file changed on disk retires it), then forks one warm process per import set on
request (:func:`start_warm`).  That one imports the group's worker modules on top and serves fork
requests on a Unix socket, one at a time, on its only Python thread; so a second worker class on
a node costs the import of its own modules, not torch's again.  Neither starts threads of its
own, a torch thread pool, a CUDA context or a process group, and a warm process whose modules
did (a Python thread started at import, a CUDA context) refuses to fork and says which modules:
a fork would leave the rank without that thread (and with any lock it held) or unable to use
CUDA.  The base dies with its keeper, and an import set's warm process with its base.  Their
sockets are abstract (nothing on disk), and each takes connections from its own user only.  A warm process watches each rank's holder
through a pidfd and kills the rank when its holder goes: a rank cannot be made to die with a
process that is not its parent, and a stopped rank would never read its closed channels.

**A fork request** (:class:`ForkRequest`) comes from the holder of the group's forked ranks on
the node (:class:`.forked.ForkedRanks`), a light Ray actor: the environment, working directory and
``sys.path`` a Ray worker in the rank's bundle would have (its ``CUDA_VISIBLE_DEVICES`` included),
where the rank runs as Ray sees it (:class:`.hostapi.HostPlace`), and three socket ends passed as
file descriptors: the rank's default, control and objects channels, with the holder's stdout and
stderr (what the rank prints is logged and shown as the holder's).  The child
takes them (:func:`become_rank`), re-seeds the random generators a spawned process seeds from the
operating system (a fork would share the warm process's), sets torch's thread count as a spawned rank's would be, builds its
:class:`.host.WorkerHost` and serves each channel on its own thread, as a Ray actor serves its
default and control concurrency groups.  The rank exits when its holder goes (either channel
closes, or this process kills it), and its holder tells the rank's callers the moment it exits
(:mod:`.forked`).

**Ray's objects** reach a forked rank through its holder, which keeps each ObjectRef and hands the
rank a :class:`RefToken` for it; the rank's object transport (:class:`HolderObjects`, reshard's
``put``/``get``/``wait_any``) asks the holder on the objects channel.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import io
import json
import logging
import os
import pickle
import random
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ray import ObjectRef, cloudpickle

from rankmesh.errors import BackendError, RayHandleInChannel

from .files import is_ray_handle
from .hostapi import ANSWER_PARTS, HostPlace
from .runtime import worker_raylet_pid

logger = logging.getLogger(__name__)

#: How long the warm process waits in ``accept`` before it reaps its exited children (seconds).
REAP_EVERY_S = 1.0
#: A warm process that forked nothing for this long, and whose ranks are all gone, exits (its keeper
#: starts another on need).
IDLE_S = 900.0
#: ``prctl`` option numbers (linux/prctl.h).
PR_SET_PDEATHSIG = 1
#: The fds a fork request carries: the default, control and objects channels' ends, the holder's stdout and stderr.
CHANNEL_FDS = 5
#: A channel message's length prefix.
LENGTH = struct.Struct("!Q")
#: ``SO_PEERCRED``'s answer: the connecting process's pid, uid and gid.
PEER_CREDENTIALS = struct.Struct("3i")
#: The modules every warm process imports: what a rank's host needs before any worker class.
HOST_MODULES: tuple[str, ...] = ("rankmesh.backends.ray.host",)


@dataclass(frozen=True)
class ForkRequest:
    """What a holder sends the warm process to fork a rank (the channels travel as fds beside it)."""

    rank: int | None
    group_name: str
    env: Mapping[str, str]  # a Ray worker's in the rank's bundle (.forked.ForkedRanks)
    cwd: str
    sys_path: tuple[str, ...]
    place: HostPlace


# ----- channels: one request, one answer, length-prefixed pickles ---------------------------------


@dataclass(frozen=True)
class RefToken:
    """A Ray ObjectRef as a forked rank holds it: the number its holder keeps the reference under.

    Why: a forked rank has no Ray worker, and an ObjectRef pickled outside Ray's serialization
    is pinned for good, so the reference stays in the holder (:class:`.forked.RefTable`) and the
    rank names it by number.  A token is good while the call that brought it (or put its object)
    runs: the holder lets its references go when that call answers."""

    number: int


class NoHandles(cloudpickle.CloudPickler):
    """cloudpickle that refuses Ray's handles: the process on the other end has no Ray worker to use them.

    A :class:`RefToken` travels as its number (a persistent id), which the holder reads back as
    the ObjectRef it stands for."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)

    def persistent_id(self, obj: Any) -> Any:
        return obj.number if type(obj) is RefToken else None

    def reducer_override(self, obj: Any) -> Any:
        if is_ray_handle(obj):
            raise RayHandleInChannel(type(obj).__name__)
        return super().reducer_override(obj)


def encode_message(value: Any, make_pickler: Callable[[io.BytesIO], cloudpickle.CloudPickler] = NoHandles) -> memoryview:
    """``value`` pickled by ``make_pickler(file)`` (cloudpickle: a worker may return what only cloudpickle
    carries); :class:`RayHandleInChannel` if it holds a Ray handle the pickler does not carry."""
    buffer = io.BytesIO()
    make_pickler(buffer).dump(value)
    return buffer.getbuffer()


def send_encoded(conn: socket.socket, payload: memoryview) -> None:
    conn.sendall(LENGTH.pack(len(payload)))
    conn.sendall(payload)


def send_message(conn: socket.socket, value: Any) -> None:
    """Send ``value`` on ``conn`` (:func:`encode_message`, then :func:`send_encoded`)."""
    send_encoded(conn, encode_message(value))


def _no_refs(number: Any) -> Any:
    raise pickle.UnpicklingError(f"a Ray object reference ({number}) arrived on a channel that carries none")


class _Reader(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, load_ref: Callable[[int], Any]) -> None:
        super().__init__(file)
        self.persistent_load = load_ref


def receive_message(conn: socket.socket, load_ref: Callable[[int], Any] = _no_refs) -> Any:
    """The next message on ``conn``; :class:`EOFError` when its other end closed.  ``load_ref``
    turns each object reference's number back into what it stands for on this side (the
    ObjectRef in the holder, a :class:`RefToken` in the rank)."""
    (size,) = LENGTH.unpack(_receive_exactly(conn, LENGTH.size))
    file = io.BytesIO()
    if size:
        file.seek(size - 1)
        file.write(b"\0")
        with file.getbuffer() as view:
            _receive_into(conn, view)
        file.seek(0)
    return _Reader(file, load_ref).load()


def receive_payload(conn: socket.socket) -> bytearray:
    """The next message on ``conn`` as its bytes, not unpickled (:class:`Sealed`)."""
    (size,) = LENGTH.unpack(_receive_exactly(conn, LENGTH.size))
    return _receive_exactly(conn, size)


class _Recording(NoHandles):
    """:class:`NoHandles` that notes the number of each :class:`RefToken` it pickles into ``numbers``."""

    def __init__(self, file: Any, numbers: list[int]) -> None:
        super().__init__(file)
        self.numbers = numbers

    def persistent_id(self, obj: Any) -> Any:
        number = super().persistent_id(obj)
        if number is not None:
            self.numbers.append(number)
        return number


class Sealed:
    """A forked rank's answer on its way through the holder: the rank's pickle, opened by whoever
    reads it, not by the holder.

    Why: a holder that unpickled its rank's answer to hand it to Ray would import what the answer
    needs (torch, for a tensor: 2.7 CPU-seconds) and copy it twice more.  Sealed, the bytes ride
    out of band in Ray's object and :func:`unseal` rebuilds the value where Ray unpickles it (the
    controller, a node agent, another rank).  ``refs``: (number, ObjectRef) of each reference
    token in the pickle, carried under Ray's own serialization beside it."""

    __slots__ = ("payload", "refs")

    def __init__(self, payload: bytearray | memoryview, refs: tuple[tuple[int, Any], ...]) -> None:
        self.payload = payload
        self.refs = refs

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return unseal, (pickle.PickleBuffer(self.payload), self.refs)


#: Set in a forked rank's holder (:func:`pass_sealed_in_this_process`): every sealed value Ray
#: rebuilds there (a call's stored argument, what the rank asked to fetch) is passed on unopened.
_PASSING = threading.Event()


def pass_sealed_in_this_process() -> None:
    """From now on :func:`unseal` in this process gives the :class:`Sealed` back unopened, to be sent
    on to the rank that opens it (a holder would import what the value needs, torch for a tensor)."""
    _PASSING.set()


def unseal(payload: Any, refs: tuple[tuple[int, Any], ...]) -> Any:
    """The value a :class:`Sealed` holds, its reference numbers turned into what ``refs`` pairs them
    with (ObjectRefs, or in a forked rank :class:`RefToken` s); in a holder, the :class:`Sealed` itself."""
    if _PASSING.is_set():
        return Sealed(payload, refs)
    if not refs:
        return pickle.loads(payload)
    return _Reader(io.BytesIO(payload), dict(refs).__getitem__).load()


class _Sealing(NoHandles):
    """:class:`NoHandles` that numbers each ObjectRef it meets and notes the reference in ``refs``."""

    def __init__(self, file: Any, refs: list[Any]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, ObjectRef):
            self.refs.append(obj)
            return len(self.refs)
        return super().persistent_id(obj)


def seal(value: Any) -> Sealed:
    """``value`` as a caller stores it for forked ranks: pickled here, carried by Ray unopened
    through their holders and opened by each rank (a rank in its own actor opens it as Ray reads it).

    Why: Ray unpickles a task's stored arguments before the holder's method runs, so a batch or a
    future passed along would make the holder import torch and copy it twice more.  The
    ObjectRefs inside (a future's parts) ride beside the pickle under Ray's own serialization."""
    refs: list[Any] = []
    payload = encode_message(value, functools.partial(_Sealing, refs=refs))
    return Sealed(payload, tuple(enumerate(refs, 1)))


def _receive_exactly(conn: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    _receive_into(conn, memoryview(buffer))
    return buffer


def _receive_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise EOFError("the channel's other end closed")
        got += n


# ----- the forked rank ----------------------------------------------------------------------------


class HolderObjects:
    """A forked rank's object transport (:class:`~rankmesh.backend.ObjectTransport`): its holder's
    ``ray.put`` / ``ray.get`` / ``ray.wait``, asked on the objects channel.

    Reshard moves weights through Ray's object store from inside the ranks; a forked rank has no
    Ray worker, so its holder does each step for it and hands back :class:`RefToken` s for the
    references.  Every value crosses the channel once more than with a rank in its own actor.
    Pairs of ranks on one node read each other's memory directly, as Ray actors do: forked ranks
    descend from the node's raylet too (raylet, keeper, warm process, rank)."""

    def __init__(self, conn: socket.socket) -> None:
        #: What a colocated role of this process left for another role of it (see the protocol).
        self.outbox: dict[Any, Any] = {}
        self._conn = conn
        self._lock = threading.Lock()
        self._raylet: int | None = None

    def _ask(self, request: tuple[Any, ...], payload: memoryview | None = None) -> Any:
        with self._lock:
            try:
                send_message(self._conn, request)
                if payload is not None:
                    send_encoded(self._conn, payload)
                status, value = receive_message(self._conn, RefToken)
            except (EOFError, OSError):
                os._exit(0)  # the holder is gone: so is its rank
        if status == "error":
            raise value
        return value

    def put(self, value: Any) -> RefToken:
        """``value`` stored by the holder as this rank pickled it (:class:`Sealed`: the holder reads none of it)."""
        numbers: list[int] = []
        payload = encode_message(value, functools.partial(_Recording, numbers=numbers))
        return self._ask(("put", numbers), payload)

    def get(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        return self._ask(("get", list(handles), timeout))

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[int]:
        return self._ask(("wait_any", list(handles), timeout))

    def peer_tracer(self) -> int | None:
        if self._raylet is None:
            self._raylet = worker_raylet_pid()
        return self._raylet


def become_rank(request: ForkRequest, default: socket.socket, control: socket.socket, objects: socket.socket,
                imported_env: Mapping[str, str]) -> None:
    """The forked child's life: take the holder's environment, build the host, serve both channels; never returns.

    ``imported_env``: what the warm process's imports set in its environment (torch sets a cache
    directory), kept where the holder's environment does not say otherwise, as a spawned rank's
    own imports would have set them."""
    code = 0
    try:
        os.environ.clear()
        os.environ.update(imported_env)
        os.environ.update(request.env)
        os.chdir(request.cwd)
        sys.path[:] = list(request.sys_path)
        _reseed()
        _set_threads(request.env)
        from .host import WorkerHost  # imported by the warm process already
        from .reshard import use_holder_objects

        holder = HolderObjects(objects)
        use_holder_objects(holder)  # a future's parts are fetched through it too (.tasks)
        host = WorkerHost(request.rank, request.group_name, request.place, objects=holder)
        send_message(default, ("ok", os.getpid()))
        who = f"rank {request.rank} of {request.group_name}"
        threading.Thread(target=_serve, args=(host, control, who), name="rankmesh-control", daemon=True).start()
        _serve(host, default, who)
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        code = 1
        logger.exception("forked rank %s of %s failed", request.rank, request.group_name)
    finally:
        os._exit(code)


def _reseed() -> None:
    """Random state as a spawned process starts with it.

    Python's and numpy's global generators and torch's CPU generator seed themselves from the
    operating system when a process starts, so each spawned rank draws numbers of its own; after a
    fork every rank would draw the warm process's, so they are seeded afresh here.  torch's CUDA
    generators are seeded when CUDA starts, in the rank (the warm process has no CUDA), as in a
    spawned rank: they are left alone."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # the CPU generator only: torch.seed() would seed CUDA's too


def _set_threads(env: Mapping[str, str]) -> None:
    """torch's intra-op threads as a spawned rank's: ``OMP_NUM_THREADS`` when set (torch read the
    warm process's at import), else torch's default (the warm process was started without it)."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _serve(host: Any, conn: socket.socket, who: str) -> None:
    """Run the host methods the holder forwards on ``conn``, one at a time; exit the process when it closes.

    An answer is ``("ok", reference numbers of each part)`` then each part's pickle as a payload of
    its own (one part, or :data:`.hostapi.ANSWER_PARTS`), which the holder passes on sealed
    (:class:`Sealed`); or ``("error", exception)``."""
    while True:
        try:
            name, args, kwargs = receive_message(conn, RefToken)
        except (EOFError, OSError):
            os._exit(0)  # the holder is gone: so is its rank
        payloads: list[memoryview] = []
        try:
            value = getattr(host, name)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - it travels back to the caller, as Ray would carry it
            answer = ("error", sendable(exc))
        else:
            try:
                parts = value if name in ANSWER_PARTS else (value,)
                numbers: list[list[int]] = [[] for _ in parts]
                payloads = [encode_message(part, functools.partial(_Recording, numbers=n)) for part, n in zip(parts, numbers)]
                answer = ("ok", numbers)
            except Exception as exc:  # noqa: BLE001 - an output that does not pickle, or holds a Ray handle
                answer = ("error", BackendError(f"{who}: its answer to {name} does not travel to its holder: {exc!r}"))
                payloads = []
            del value
        try:
            send_message(conn, answer)
            for payload in payloads:
                send_encoded(conn, payload)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(0)


def sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a BackendError with its text and traceback."""
    try:
        cloudpickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return BackendError(f"{type(exc).__name__}: {exc} (it does not pickle; the rank's traceback follows)\n{text}")


# ----- the warm process ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _source_files(before: set[str]) -> list[tuple[str, int, int]]:
    """(path, mtime_ns, size) of every module imported since ``before`` that has a source file outside the interpreter's own."""
    prefixes = tuple({sys.base_prefix, sys.prefix})
    files = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name in before or not path or path.startswith(prefixes):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        files.append((path, st.st_mtime_ns, st.st_size))
    return sorted(files)


def serve_base(address: str, sys_path: Sequence[str]) -> None:
    """The base warm process of a node and ``sys.path``: import the host's modules, say ready on
    stdout, then fork an import set's warm process per request (:func:`_start_warm`) until the keeper goes.

    Why a base: torch and rankmesh are most of every import set's cost (1.6 of a plain rank's
    1.7 CPU-s here), and every group on the node needs them.  A second worker class on the node
    then costs the import of its own modules alone."""
    _die_with_parent()
    sys.path[:] = list(sys_path)
    parent = os.getppid()
    start_env = dict(os.environ)
    before = set(sys.modules)
    failed = _import_all(HOST_MODULES)
    listener = _listen(address)
    sys.stdout.write(json.dumps({"pid": os.getpid(), "files": _source_files(before), "failed": failed}) + "\n")
    sys.stdout.flush()
    warms: set[int] = set()
    last = time.monotonic()
    while os.getppid() == parent and (warms or time.monotonic() - last < IDLE_S):
        warms -= _reap()
        if not select.select([listener], [], [], REAP_EVERY_S)[0]:
            continue
        last = time.monotonic()
        conn = _accept(listener)
        if conn is None:
            continue
        with conn:
            try:
                conn.settimeout(REAP_EVERY_S)
                asked = json.loads(receive_payload(conn))
            except Exception:  # noqa: BLE001 - a broken request fails its keeper, not this process
                logger.exception("a warm process request did not arrive whole")
                continue
            base = os.getpid()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _start_warm(conn, base, asked["address"], asked["modules"], start_env, failed)
            warms.add(pid)


def _start_warm(conn: socket.socket, base: int, address: str, modules: Sequence[str], start_env: Mapping[str, str],
                failed: Mapping[str, str]) -> None:
    """The life of an import set's warm process, forked from its ``base`` (pid): import ``modules``,
    say ready on ``conn`` (or why it may not fork ranks), then serve fork requests; never returns."""
    code = 0
    try:
        _die_with_parent()
        if os.getppid() != base:  # the base went before this process could follow it
            return
        before = set(sys.modules)
        failed = {**failed, **_import_all(modules)}
        unsafe = _fork_hazards(modules)
        listener = None if unsafe else _listen(address)
        send_message(conn, {"pid": os.getpid(), "files": _source_files(before), "failed": failed, "unsafe": unsafe})
        conn.close()
        if listener is not None:
            imported_env = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
            serve_forks(listener, imported_env)
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        code = 1
        logger.exception("the warm process for %s failed", list(modules))
    finally:
        os._exit(code)


def _import_all(modules: Sequence[str]) -> dict[str, str]:
    """Import each of ``modules``; the ones that failed, with why (the rank reports it where it builds the worker)."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the rank reports it where it builds the worker
            failed[name] = repr(exc)
    return failed


def _fork_hazards(modules: Sequence[str]) -> str:
    """Why this process may not fork ranks after importing ``modules``, or ``""``.

    A fork copies one thread: a Python thread that a module started at import would be missing
    from every rank, with whatever lock it held held for good; a CUDA context does not survive a
    fork at all (the rank's first CUDA call fails).  Threads of native pools (OpenBLAS's) are not
    counted: they re-create themselves in a child."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return (f"importing {list(modules)} started Python threads {threads}: a forked rank would lack them, and any "
                f"lock they hold at the fork would stay held in the rank")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hint = ("; transformer-engine does so at import in some versions (NVTE_TORCH_COMPILE=0 avoids it there)"
                if "transformer_engine" in sys.modules else "")
        return f"importing {list(modules)} created a CUDA context, which a forked rank cannot use{hint}"
    return ""


def _listen(address: str) -> socket.socket:
    """A socket listening at ``address`` (:func:`abstract`)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(abstract(address))
    listener.listen(64)
    return listener


def abstract(address: str) -> str:
    """The abstract Unix socket named ``address`` (a leading NUL): nothing on disk to leave behind
    when a node's processes are killed, and no other user gets through (:func:`_accept`)."""
    return "\0" + address


def _accept(listener: socket.socket) -> socket.socket | None:
    """The next connection, if it comes from a process of this user (an abstract socket has no
    file permissions: any process in the network namespace may connect); ``None`` otherwise."""
    conn, _ = listener.accept()
    pid, uid, _ = PEER_CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size))
    if uid == os.getuid():
        return conn
    logger.warning("refused a connection from pid %d of user %d (this process serves user %d only)", pid, uid, os.getuid())
    conn.close()
    return None


def serve_forks(listener: socket.socket, imported_env: Mapping[str, str]) -> None:
    """An import set's warm process: fork a rank per request on ``listener`` until its base goes.

    ``imported_env``: what the imports set in the environment (:func:`become_rank`)."""
    parent = os.getppid()
    holders: dict[int, int] = {}  # a holder's pidfd -> its rank's pidfd
    last = time.monotonic()
    while os.getppid() == parent and (holders or time.monotonic() - last < IDLE_S):
        _reap()
        readable, _, _ = select.select([listener, *holders], [], [], REAP_EVERY_S)
        for fd in readable:
            if fd is not listener:  # a holder is gone: so is its rank, even one stopped (a channel's end it cannot read)
                kill_by_pidfd(holders.pop(fd))
                os.close(fd)
        if listener not in readable:
            continue
        last = time.monotonic()
        conn = _accept(listener)
        if conn is None:
            continue
        with conn:
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, CHANNEL_FDS)
                request = pickle.loads(message)
            except Exception:  # noqa: BLE001 - a broken request fails its holder, not the warm process
                logger.exception("a fork request did not arrive whole")
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for fd in (*holders, *holders.values()):
                    os.close(fd)
                os.dup2(fds[3], 1)  # the holder's stdout and stderr: Ray logs them and shows them to the driver
                os.dup2(fds[4], 2)
                os.close(fds[3])
                os.close(fds[4])
                become_rank(request, *(socket.socket(fileno=fd) for fd in fds[:3]), imported_env)
            for fd in fds:
                os.close(fd)
            rank = os.pidfd_open(pid)
            try:
                holders[os.pidfd_open(request.place.ray_pid)] = rank
            except ProcessLookupError:  # the holder went while its rank was forked
                kill_by_pidfd(rank)
            conn.sendall(LENGTH.pack(pid))


def kill_by_pidfd(pidfd: int) -> None:
    """SIGKILL the process behind ``pidfd`` (a pidfd: a pid reused since cannot be hit; gone already: nothing) and close it."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.close(pidfd)


def _reap() -> set[int]:
    """Collect the exit of every child that ended (a rank's holder saw it through a pidfd already); their pids."""
    reaped = set()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.add(pid)


def fork_rank(address: str, request: ForkRequest, channels: Sequence[socket.socket], timeout: float) -> int:
    """Ask the warm process at ``address`` to fork ``request``'s rank with these channel ends (default,
    control, objects) and the caller's stdout and stderr; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(abstract(address))
        socket.send_fds(conn, [cloudpickle.dumps(request, protocol=5)], [*(c.fileno() for c in channels), 1, 2])
        (pid,) = LENGTH.unpack(_receive_exactly(conn, LENGTH.size))
    return pid


def start_warm(base: str, address: str, modules: Sequence[str], timeout: float) -> dict[str, Any]:
    """Ask the base warm process at ``base`` for a warm process of ``modules`` listening at
    ``address``; what it said once ready: ``pid``, the source ``files`` it read, the modules that
    ``failed`` to import and why, and why it is ``unsafe`` to fork from (``""``: it is not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(abstract(base))
        send_encoded(conn, memoryview(json.dumps({"address": address, "modules": list(modules)}).encode()))
        return receive_message(conn)


if __name__ == "__main__":
    serve_base(sys.argv[1], json.loads(sys.argv[2]))
