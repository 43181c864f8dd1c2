"""What this process is doing now: every thread's Python stack, and the collective it waits in.

:func:`capture_process` is called *inside* a rank's process by a thread other than the one
running the call (the Ray host answers it from its ``control`` concurrency group), so it sees the
call's thread while that thread is still blocked.  ``sys._current_frames()`` gives every thread's
innermost frame even while the thread waits in C code (a gloo collective, ``time.sleep``): what
it needs is the GIL for a moment, which such code has released, and which a pure-Python loop
gives up every switch interval (5 ms).

The collective: torch.distributed's public functions (``all_reduce``, ``barrier``, ``send`` ...)
live in ``torch/distributed/distributed_c10d.py`` and block in C++ below their own frame, so the
outermost frame of that file on the call's stack is the operation the user called, and its
``group`` local is the process group (``None``: the world).  torch is never imported here: a
process inside a collective has imported it already (``sys.modules``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from itertools import combinations
from types import FrameType, MappingProxyType
from typing import Any

from rankmesh.mesh import DENSE_AXES, RankMesh

#: How deep a stack is kept per thread (innermost frames first): enough to reach user code from
#: inside a library, bounded so a deep recursion does not make the report huge.
MAX_FRAMES = 64

#: torch.distributed's module of collectives; its functions' ``group`` local names the group.
C10D_MODULE = "torch.distributed.distributed_c10d"

#: Point-to-point operations: the report names the peer rank too (their ``dst``/``src`` local).
P2P_PEER = MappingProxyType({"send": "dst", "recv": "src", "isend": "dst", "irecv": "src", "send_object_list": "dst", "recv_object_list": "src"})


@dataclass(frozen=True)
class Frame:
    """One Python frame: function, file and line."""

    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class Collective:
    """A torch.distributed operation a thread is blocked in.

    ``ranks``: the group's global ranks (group rank order); ``group``: its name on the mesh
    (``"dp"``, ``"tp-pp"``, ``"world"``, ``"unnamed"``); ``peer``: the other rank of a send or recv.
    """

    op: str
    ranks: tuple[int, ...]
    group: str
    peer: int | None = None

    def __str__(self) -> str:
        return collective_text(self.op, self.group, [self.ranks], self.peer)


def collective_text(op: str, group: str, members: list[tuple[int, ...]], peer: int | None = None) -> str:
    """``all_reduce on dp group [1, 3]``; several groups of one axis: ``on dp groups [0, 2], [1, 3]``."""
    label = "world" if group == "world" else group
    plural = "s" if len(members) > 1 else ""
    lists = ", ".join(f"[{', '.join(map(str, m))}]" for m in members)
    return f"{op} on {label} group{plural} {lists}" + ("" if peer is None else f" (peer rank {peer})")


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack, innermost frame first; ``call``: the thread running the rank's call."""

    ident: int
    name: str
    frames: tuple[Frame, ...]
    call: bool = False


@dataclass(frozen=True)
class ProcessStacks:
    """Every thread of one process, the call's thread first, and where that thread is."""

    pid: int
    threads: tuple[ThreadStack, ...]
    place: Frame | None = None  # innermost frame of user code on the call's thread
    collective: Collective | None = None  # the torch.distributed operation it is blocked in
    busy: bool = True  # False: the host runs no call (it finished, or has not started one)


def capture_process(call_thread: int | None, mesh: RankMesh | None = None) -> ProcessStacks:
    """The stacks of every thread of this process (``call_thread``: the ident running the call).

    ``mesh`` names a collective's group by its mesh axes; without it the group is ``"unnamed"``
    unless it is the whole world.
    """
    frames = sys._current_frames()
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    threads, call_frame = [], None
    for ident, top in frames.items():
        if ident == me:
            continue  # this thread, answering
        is_call = ident == call_thread
        threads.append(ThreadStack(ident, names.get(ident, "?"), _walk(top), is_call))
        if is_call:
            call_frame = top
    threads.sort(key=lambda t: not t.call)
    if call_frame is None:
        return ProcessStacks(os.getpid(), tuple(threads), busy=False)
    return ProcessStacks(
        os.getpid(), tuple(threads), place=innermost_user_frame(threads[0].frames), collective=_collective(call_frame, mesh)
    )


def _walk(top: FrameType | None) -> tuple[Frame, ...]:
    out = []
    frame = top
    while frame is not None and len(out) < MAX_FRAMES:
        out.append(Frame(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


#: rankmesh's own call path in a worker process (host, invoke, the ``@register`` wrapper, the
#: trace timer): frames of these files wrap the user's method and are never the place it is stuck.
PLUMBING = ("worker.py", "dispatch/register.py", "backends/ray/host.py", "tracing/recorder.py")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def library_roots() -> tuple[str, ...]:
    """Where frames are not the user's: the standard library first, then torch, Ray and rankmesh's call path."""
    roots = [sysconfig.get_paths()["stdlib"]]
    for name in ("torch", "ray"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.append(os.path.dirname(module.__file__))
    dirs = tuple(os.path.join(os.path.realpath(r), "") for r in roots)
    return dirs + tuple(os.path.join(_PACKAGE, p) for p in PLUMBING)


def is_library_file(path: str, roots: tuple[str, ...] | None = None) -> bool:
    """Whether a frame of ``path`` belongs to the standard library, torch or Ray (not user code)."""
    if path.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    roots = library_roots() if roots is None else roots
    real = os.path.realpath(path)
    for i, root in enumerate(roots):
        if real.startswith(root):
            rest = real[len(root):]
            # A system Python keeps installed packages inside the standard library's directory.
            if i == 0 and ("site-packages" in rest or "dist-packages" in rest):
                continue
            return True
    return False


def innermost_user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame outside the standard library, torch, Ray and rankmesh's call path (else the innermost)."""
    roots = library_roots()
    for frame in frames:
        if not is_library_file(frame.file, roots):
            return frame
    return frames[0] if frames else None


def _collective(top: FrameType, mesh: RankMesh | None) -> Collective | None:
    """The outermost torch.distributed collective frame on the stack from ``top``, if any."""
    found = None
    frame: FrameType | None = top
    while frame is not None:
        if frame.f_globals.get("__name__") == C10D_MODULE and not frame.f_code.co_name.startswith("_"):
            found = frame  # keep going: the outermost is the one the user called
        frame = frame.f_back
    if found is None:
        return None
    dist = sys.modules.get("torch.distributed")
    op = found.f_code.co_name
    values = found.f_locals
    try:
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(values.get("group")))  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a group torch no longer knows, or no torch.distributed
        ranks = ()
    peer = values.get(P2P_PEER.get(op, ""), None)
    return Collective(op, ranks, name_group(mesh, ranks), int(peer) if isinstance(peer, int) else None)


def _tokens(mesh: RankMesh, expert: bool) -> list[tuple[str, ...]]:
    """Axis combinations of a mesh view whose groups have more than one rank, fewest axes first."""
    grid = mesh.expert if expert else mesh.dense
    axes = [a for a in grid.axes if grid.sizes[a] > 1 and (expert or a in DENSE_AXES)]
    return [combo for n in range(1, len(axes) + 1) for combo in combinations(axes, n)]


def name_group(mesh: RankMesh | None, ranks: Any) -> str:
    """The mesh's name for the process group of ``ranks``: ``"dp"``, ``"tp-pp"``, ``"world"``, else ``"unnamed"``.

    Axis combinations are tried fewest axes first, named in the mesh's order (``"tp-dp"`` on a
    ``tp-cp-ep-dp-pp`` mesh); the expert view's groups are prefixed ``"expert "`` unless they
    are dense groups too.
    """
    members = sorted(int(r) for r in ranks)
    if mesh is None:
        return "unnamed"
    if members == list(range(mesh.world_size)):
        return "world"
    for expert in (False, True):
        for combo in _tokens(mesh, expert):
            token = "-".join(combo)
            if any(sorted(g) == members for g in mesh.groups(token, expert=expert)):
                return f"expert {token}" if expert and token != "ep" else token
    return "unnamed"
