"""The worker-process side of replacing dead ranks: leave and re-form torch.distributed, restore state.

The controller (:mod:`.recovery`) drives these steps through :class:`~.host.WorkerHost`; every
role object of the process takes part through the three hooks of :class:`rankmesh.worker.Worker`
(``leave_distributed``, ``rejoin_distributed``, ``restore_from_peer``), called in the process's
role order, which is the same in every process of the group.

Why leaving also frees blocked peers: a survivor that was in a gloo collective with the dead
rank gets an error within milliseconds (the kernel closes the dead process's sockets), but one
that waits on a *live* peer which itself already failed would wait for gloo's timeout.  Each
survivor leaves as soon as its own call has ended, and dropping its process groups closes its
gloo connections, so the peers waiting on it fail in turn: the group drains rank by rank.
Dropping means every reference: ``destroy_process_group`` alone (or gloo's ``abort``) leaves
the sockets open while anything still holds the group object (measured: the peer stayed
blocked until this process exited), hence the workers clear what they hold in
``leave_distributed`` (megatron: captured groups and parallel_state's globals), the failed
call's frames are cleared (:func:`rankmesh.worker.invoke`) and the garbage collector runs last.

Why a survivor also cuts its connections to a lost node (:func:`sever`): a peer whose node was
cut off (a partition) still lives, so the kernel closes nothing, and a collective waiting on it
would wait for gloo's timeout (10 minutes) or until the link heals.  Once the GCS has declared
the node dead nothing legitimate can come from it, so each survivor shuts down its own TCP
connections to that address, from its control thread, while its call thread still waits: the
collective gets gloo's "connection closed" at once, as after a process death.
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import logging
import os
import signal
import socket
from typing import Any, Iterable, Mapping

import torch.distributed as dist

from rankmesh.worker import invoke

from rankmesh.rendezvous import init_torch_distributed

logger = logging.getLogger(__name__)

#: How long a re-formed default group waits for its members (the controller bounds the whole step).
REJOIN_TIMEOUT = datetime.timedelta(minutes=10)


def leave(workers: Mapping[Any, Any]) -> str | None:
    """A survivor's first step: every role lets go of its groups, then the default group goes.

    Returns the backend the default group had (``None``: torch.distributed was not in use), so
    that :func:`rejoin` re-forms the same one.
    """
    backend = str(dist.get_backend()) if dist.is_initialized() else None
    for worker in workers.values():
        invoke(worker, "leave_distributed")
    if dist.is_initialized():
        dist.destroy_process_group()
    # A gloo group closes its connections only when its last reference goes, and the failed call
    # left some in reference cycles (its exception's traceback holds the frames that held the
    # group): collect them now, so the peers still waiting on this rank get their error.
    gc.collect()
    return backend


def sever(addresses: Iterable[str]) -> int:
    """Shut down every TCP connection of this process to ``addresses`` (nodes declared dead); how many.

    The connections are found in ``/proc/self/net/tcp`` and ``tcp6`` by remote address, and
    matched to this process's descriptors by socket inode.  Each is shut down, not closed: its
    descriptor stays its owner's (gloo's), whose blocked reads and writes then fail.
    """
    lost = {ipaddress.ip_address(a) for a in addresses}
    if not lost:
        return 0
    fds: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fds[target[len("socket:["):-1]] = int(name)
    severed = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            fd = fds.get(fields[9])
            if fd is None or _remote_address(fields[2]) not in lost:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                severed += 1
            except OSError:  # already down
                pass
            finally:
                sock.detach()  # the descriptor stays open: it is its owner's to close
    if severed:
        logger.warning("cut %d connection(s) to lost node(s) %s: collectives waiting on them fail now",
                       severed, sorted(map(str, lost)))
    return severed


def _remote_address(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The remote address of a ``/proc/net/tcp`` row (``rem_address``: hex, 32-bit words in host order);
    an IPv4-mapped IPv6 address as its IPv4 one."""
    hexaddr = field.split(":")[0]
    raw = b"".join(int(hexaddr[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(hexaddr), 8))
    addr = ipaddress.ip_address(raw)
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped if mapped is not None else addr


def rejoin(workers: Mapping[Any, Any], backend: str | None) -> None:
    """Re-form the default group from the (updated) environment, then every role rebuilds its groups."""
    if backend is not None and not dist.is_initialized():
        init_torch_distributed(backend=backend, timeout=REJOIN_TIMEOUT)
    for worker in workers.values():
        invoke(worker, "rejoin_distributed")


def restore(workers: Mapping[Any, Any], peer_rank: int, sending: bool) -> None:
    """Run every role's ``restore_from_peer`` (see :meth:`rankmesh.worker.Worker.restore_from_peer`)."""
    for worker in workers.values():
        invoke(worker, "restore_from_peer", (peer_rank, sending))


def recovery_states(workers: Mapping[Any, Any]) -> dict[Any, Any]:
    """Every role's :meth:`~rankmesh.worker.Worker.recovery_state`, by role (a live peer's)."""
    return {role: invoke(worker, "recovery_state") for role, worker in workers.items()}


def load_recovery_states(workers: Mapping[Any, Any], states: Mapping[Any, Any]) -> None:
    """Give each role of a replaced rank its peer's state (:meth:`~rankmesh.worker.Worker.load_recovery_state`)."""
    for role, state in states.items():
        if state is not None:
            invoke(workers[role], "load_recovery_state", (state,))


def exit_on_call(worker: Any, method: str) -> None:
    """Fault injection: the next call of ``method`` on ``worker`` SIGKILLs this process on entering it.

    The kill happens before the method's first line, so nothing of the call has run on this rank;
    the instance attribute set here shadows the class's method (a replaced process has none).
    """
    original = getattr(worker, method)

    def die(*args: Any, **kwargs: Any) -> Any:
        # INFO, not a warning: the driver's group reports the death in one line; a warning here would
        # reach the driver's terminal through Ray as a second line for one kill.
        logger.info("fault injection: rank process %d killed on entering %s", os.getpid(), method)
        os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)  # pragma: no cover - never reached

    setattr(worker, method, die)
