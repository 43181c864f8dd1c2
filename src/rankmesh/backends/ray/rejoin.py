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
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import signal
from typing import Any, Mapping

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
