"""Ray's notices of rank deaths that the group reports itself: kept out of the terminal, logged at DEBUG.

Why: when a process dies, its raylet publishes a notice that Ray's driver prints as it arrives:
a 900-character "(raylet) A worker died or was killed while executing a task ..." paragraph on
the OOM killer, ``ray stop --force`` and ``--enable-resource-isolation``, in ANSI colours even
into a file.  For a rank of a rankmesh group it says nothing the group does not say better: the
group raises ``WorkerDiedError`` naming the rank, its coordinates and node, or, when its policy
replaces or shrinks, logs one line of what died and what was done.  Printed beside that line,
an intended kill (``kill_ranks``, a fault drill, the demo's ``--kill-rank``) reads as a crash.

So the driver's printer of Ray's error channel is wrapped once, when the first group's
processes are watched (:meth:`RankNotices.watch`): a death notice whose ``Worker PID`` is a
process of a watched :class:`~.hosts.HostSet` (a rank now, or one before a replacement or a
shrink) goes to this module's logger at DEBUG, and every other notice prints as Ray prints it.
Ray prints these through one function of ``ray._private.worker`` (``print_to_stdstream``),
looked up by its error-listener thread at each call; were a Ray release to drop it, nothing is
wrapped and Ray's notice prints as before.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .hosts import HostSet

logger = logging.getLogger(__name__)

#: Ray's death notice (raylet ``worker_pool``/``node_manager`` text since Ray 2.x), and the pid it names.
DEATH_NOTICE = re.compile(r"A worker died or was killed\b.*?\bWorker PID: (\d+)", re.DOTALL)


class RankNotices:
    """Which processes are ranks of this driver's groups, and the wrapped printer that asks it.

    Groups are held weakly: a group that is gone stops claiming its pids.
    """

    def __init__(self) -> None:
        self._hosts: weakref.WeakValueDictionary[int, HostSet] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._wrapped = False

    def watch(self, hosts: HostSet) -> None:
        """Leave Ray's death notices of ``hosts``' processes out of the terminal from now on."""
        with self._lock:
            self._hosts[id(hosts)] = hosts
            if not self._wrapped:
                self._wrapped = True
                self._wrap()

    def rank_of(self, pid: int) -> str | None:
        """``"rank R of GROUP"`` (or ``"a former rank of GROUP"``) when ``pid`` is a watched process, else ``None``."""
        for hosts in list(self._hosts.values()):
            for info in hosts.info:
                if pid in (info.get("pid"), info.get("ray_pid")):  # a forked rank's Ray worker is its holder
                    return f"rank {info.get('rank')} of {hosts.name_prefix}"
            if pid in hosts.former_pids:
                return f"a former rank of {hosts.name_prefix}"
        return None

    def handled(self, data: dict[str, Any]) -> bool:
        """Whether the group reports this printer message itself (then it is logged, not printed)."""
        if data.get("pid") != "raylet":
            return False
        lines = data.get("lines") or []
        found = [DEATH_NOTICE.search(line) for line in lines]
        if not lines or not all(found):
            return False
        whose = [self.rank_of(int(m.group(1))) for m in found if m is not None]
        if not all(whose):
            return False
        logger.debug("Ray's notice of the death of %s, left to the group to report: %s", ", ".join(map(str, whose)),
                     " ".join(lines)[:200])
        return True

    def _wrap(self) -> None:
        from ray._private import worker as ray_worker  # deferred: Ray's internals, reached only here

        printer: Callable[..., None] | None = getattr(ray_worker, "print_to_stdstream", None)
        if printer is None:
            logger.debug("ray._private.worker has no print_to_stdstream: Ray's death notices print as Ray prints them")
            return

        def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            if not self.handled(data):
                printer(data, *args, **kwargs)

        ray_worker.print_to_stdstream = print_to_stdstream


#: The one filter of this driver process: Ray's printer is itself process-wide.
NOTICES = RankNotices()
