"""The torch.distributed rendezvous of a worker group: a race-free MASTER_PORT and an init helper.

verl finds a port by binding port 0, closing the socket and publishing the number; between the
close and torch's own bind any process may take it ("address already in use").  Here the process
of rank 0 binds a socket to ``(MASTER_ADDR, 0)`` with ``SO_REUSEADDR`` and *keeps it open* for as
long as it lives, so the kernel hands the port to no one else, then:

* :func:`init_torch_distributed` gives that very socket to ``torch.distributed.TCPStore`` as its
  listening socket (``master_listen_fd``): no second bind at all, and the store listens on
  MASTER_ADDR only (127.0.0.1 on a loopback cluster, the node address on a real one);
* user code that calls ``torch.distributed.init_process_group(init_method="env://")`` itself
  still works: torch binds the same port with ``SO_REUSEADDR``, which Linux allows next to a
  bound socket that is not listening.

Nothing here imports Ray: the helpers run inside the worker processes.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rankmesh.errors import RendezvousError
from rankmesh.validate import positive_seconds

logger = logging.getLogger(__name__)

#: Variables every worker gets; ``worker_env`` may not override them.
RESERVED_ENV: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: The variable torch's gloo reads for the network interfaces its devices bind (a comma-separated list).
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
#: ``ioctl`` request for an interface's IPv4 address (``<linux/sockios.h>``).
_SIOCGIFADDR = 0x8915

_lock = threading.Lock()
_reserved: dict[tuple[str, int], socket.socket] = {}


@dataclass(frozen=True)
class DistEnv:
    """The rendezvous variables of one worker, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "DistEnv":
        env = os.environ if environ is None else environ
        missing = [k for k in RESERVED_ENV if k not in env]
        if missing:
            raise RendezvousError(
                f"torch.distributed environment is incomplete: {', '.join(missing)} not set "
                "(is this process a rankmesh worker?)"
            )
        try:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env["LOCAL_RANK"]),
                local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as exc:
            raise RendezvousError(f"torch.distributed environment has a non-integer value: {exc}") from exc

    def as_env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def reserve_port(host: str) -> int:
    """Bind a socket to ``(host, 0)`` in this process and keep it; return the port.

    The socket stays open (bound, not listening) until :func:`init_torch_distributed` hands it
    to the TCPStore or :func:`release_port` closes it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise RendezvousError(f"cannot reserve a port on {host}: {exc}") from exc
    port = sock.getsockname()[1]
    with _lock:
        _reserved[(host, port)] = sock
    logger.debug("reserved rendezvous port %s:%d", host, port)
    return port


def is_reserved(host: str, port: int) -> bool:
    with _lock:
        return (host, port) in _reserved


def release_port(host: str, port: int) -> None:
    """Close a reservation made by :func:`reserve_port` in this process (no-op if none)."""
    with _lock:
        sock = _reserved.pop((host, port), None)
    if sock is not None:
        sock.close()


def _take_reserved(host: str, port: int) -> socket.socket | None:
    with _lock:
        return _reserved.pop((host, port), None)


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address is ``address`` (``None``: none is).

    Why: without :data:`GLOO_IFNAME`, gloo binds whatever the machine's hostname resolves to, and
    many hosts map it to 127.0.0.1 (``/etc/hosts`` in VMs and containers).  On one machine that
    works; across nodes every rank then announces 127.0.0.1 to its peers, and the first
    collective fails with "Connection refused".  The worker host names the interface that holds
    the rank's node address (the one Ray reaches it on) instead.
    """
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def default_backend() -> str:
    """``nccl`` when CUDA is usable in this process, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def create_store(env: DistEnv, timeout: datetime.timedelta):
    """The TCPStore of ``env``: the master (on the reserved socket) on rank 0, a client elsewhere."""
    sock = _take_reserved(env.master_addr, env.master_port) if env.rank == 0 else None
    if sock is not None:
        # The store owns (and will close) the descriptor from here on.
        fd = sock.detach()
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            True,
            timeout=timeout,
            master_listen_fd=fd,
            use_libuv=True,
        )
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0, timeout=timeout)


def init_torch_distributed(
    backend: str | None = None,
    timeout: datetime.timedelta | float = datetime.timedelta(minutes=10),
) -> None:
    """Initialize the default process group from the worker's RANK/WORLD_SIZE/MASTER_* variables.

    Call it inside a worker (``__init__`` or any method) on every rank of the group.  ``backend``
    defaults to nccl with CUDA and gloo without.  A second call is a no-op.
    """
    if dist.is_initialized():
        return
    env = DistEnv.from_environ()
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=positive_seconds(timeout, "init_torch_distributed(timeout)", RendezvousError))
    backend = backend or default_backend()
    store = create_store(env, timeout)
    logger.debug("rank %d/%d joins %s at %s:%d", env.rank, env.world_size, backend, env.master_addr, env.master_port)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
