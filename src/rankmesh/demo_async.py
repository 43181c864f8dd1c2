"""The demo's asynchronous rollout (``rankmesh demo --async-staleness K``): replicas generate on their own.

Why: the synchronous demo waits for every rollout replica before training and stops them all for
each refit.  Here each replica (``rollout.replica(i)``) generates its share of the prompts on its
own; finished rows go into a :class:`~rankmesh.RowBuffer` with the weight version that made them;
the trainer takes one batch at a time, dropping rows more than ``K`` versions older than the
weights it updates; and a replica that finishes behind the actor is refit alone (a rolling refit:
``reshard`` into its view) before it generates again, while the others keep generating.

What a replica may start: rows it makes now carry the actor's current version ``v`` and can serve
the steps up to ``v + K``, so it starts only when ``v >= next step - K`` (with ``K = 0`` no
replica generates during an update: the run is the synchronous one, batch for batch), and only
while the rows held and in flight stay within one batch (rows made earlier would go stale).

The batch a step trains on is put back in prompt order when it holds each prompt row once
(always with ``K = 0``, so the actor sees exactly the synchronous run's batches).

A generation that fails (a rank died, or was stuck past ``call_timeout_s`` and killed: the
groups' ``on_hang="kill"``) is counted and given to its replica again; the replica is refit
first, since its replaced rank holds the weights it started with.  So a generation is read as
soon as it is done (the trainer reads every row anyway), before its rows go into the buffer:
rows are counted as generated when they arrive, and ``generated == trained + dropped + left``
holds through faults.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rankmesh.data import DataProto
from rankmesh.data.buffer import VERSION_COLUMN, RowBuffer
from rankmesh.errors import AgentLostError, FetchTimeoutError, WorkerDiedError, WorkerError
from rankmesh.futures import wait

logger = logging.getLogger(__name__)

#: What a fault does to a call, and what the demo answers by calling again (each group recovers
#: its dead or killed ranks on its next call): a rank died, its node agent was lost with its node,
#: or it was stuck past the call's timeout (and killed, ``on_hang="kill"``).
FAULT_ERRORS = (WorkerDiedError, AgentLostError, FetchTimeoutError)
#: The exceptions on a rank that say its input was lost with the process that held it (a refit's
#: source rank that died after sending): :func:`lost_input`.
LOST_INPUT = ("ray.exceptions.OwnerDiedError", "ray.exceptions.ObjectLostError")


def lost_input(err: BaseException) -> bool:
    """Whether ``err`` is a rank's failure to read an input whose holder died (a fault elsewhere, not a bug)."""
    return isinstance(err, WorkerError) and err.cause in LOST_INPUT

#: How long the trainer waits for a generation before it looks again for ones running past their
#: timeout (seconds; only with ``call_timeout_s``).
WAIT_SLICE_S = 1.0


@dataclass
class AsyncTally:
    """What the asynchronous rollout did: rows made, trained on and dropped, refits, the worst lag."""

    staleness: int
    rows_generated: int = 0
    rows_trained: int = 0
    rows_dropped: int = 0
    rows_left: int = 0  # made but neither trained on nor dropped when the run ended
    generations_failed: int = 0  # replica generations that raised (each given to its replica again)
    failures: list[str] = field(default_factory=list)  # the first line of each one's error
    max_lag: int = 0  # versions the oldest row trained on lagged the weights it updated, at worst
    lags: list[int] = field(default_factory=list)
    refit_bytes: list[int] = field(default_factory=list)  # one per rolling refit


class AsyncRollout:
    """The rollout's replicas generating on their own for a trainer that takes one batch per step.

    ``steps``: how many batches the trainer will take (no replica generates for a step beyond).
    ``refit(view)`` refits one replica view from the actor and returns the bytes it moved (the
    demo's ``reshard`` with the view's plan).  ``version`` is the actor's weight version (updates
    done); the controller raises it with :meth:`updated` after each update.  ``call_timeout_s``:
    the rollout group's call timeout, past which a generation is read (so that its ``HangError``
    comes) instead of waited for.
    """

    def __init__(self, rollout: Any, prompts: DataProto, staleness: int, steps: int, refit: Any,
                 call_timeout_s: float | None = None) -> None:
        self.rollout, self.staleness, self.steps, self._refit = rollout, staleness, steps, refit
        self.call_timeout_s = call_timeout_s
        self.started: dict[int, float] = {}  # replica -> when its running generation was issued
        self.suspect: set[int] = set()  # replicas whose last generation failed: refit before the next
        replicas = rollout.mesh.size("dp")
        self.views = [rollout.replica(i) for i in range(replicas)]
        self.chunks = prompts.chunk(replicas)
        self.rows = len(prompts)
        self.per = self.rows // replicas
        self.buffer = RowBuffer(capacity_rows=self.rows)
        self.running: dict[int, Any] = {}
        self.idle = list(range(replicas))
        self.version = 0
        self.next_step = 0
        self.tally = AsyncTally(staleness)

    def take(self, step: int) -> DataProto:
        """The rows step ``step`` trains on (weights of version ``step``): waits for generation as needed."""
        self.next_step = step
        floor = max(0, step - self.staleness)
        while True:
            self.buffer.discard(floor)
            self._service()
            if self.buffer.available(floor) >= self.rows:
                break
            wait(list(self.running.values()), timeout=None if self.call_timeout_s is None else WAIT_SLICE_S)
        taken = self.buffer.take(self.rows, min_version=floor, block=False)
        self.next_step = step + 1
        lag = taken.staleness(step)
        self.tally.lags.append(lag)
        self.tally.max_lag = max(self.tally.max_lag, lag)
        self.tally.rows_trained += taken.rows
        batch = taken.data.get()
        rows = batch.batch["row"]
        if len(set(rows.tolist())) == len(rows):  # each prompt row once: back in prompt order
            batch = batch.select_idxs(rows.argsort())
        self._service()  # with K >= 1, replicas start on the next step's rows during the update
        return batch

    def updated(self, version: int) -> None:
        """The actor now holds weights of ``version``: idle replicas behind it are refit and set generating."""
        self.version = version
        self._service()

    def finish(self) -> AsyncTally:
        """Wait for the generations still running and count their rows (they are left over)."""
        while self.running:  # a generation past its timeout is read (and fails) rather than waited for
            wait(list(self.running.values()), num_returns=len(self.running),
                 timeout=None if self.call_timeout_s is None else WAIT_SLICE_S)
            self._collect()
        self.tally.rows_dropped = self.buffer.dropped_rows
        self.tally.rows_left = self.buffer.rows
        return self.tally

    def _collect(self) -> None:
        """Put the rows of every finished generation into the buffer, with the version that made them.

        A generation past the rollout's call timeout is read too: it raises its ``HangError``
        (its stuck rank killed) rather than holding the trainer.  A failed generation is counted
        and its replica goes back to the idle ones, to be refit and given its prompts again.
        """
        if not self.running:
            return
        done, _ = wait(list(self.running.values()), num_returns=len(self.running), timeout=0)
        late = time.monotonic() - (self.call_timeout_s or 0.0)
        for i, fut in list(self.running.items()):
            if fut not in done and (self.call_timeout_s is None or self.started[i] > late):
                continue
            del self.running[i]
            self.idle.append(i)
            try:
                rows = fut.get()
            except FAULT_ERRORS as err:
                self._failed(i, err)
                continue
            # The rows' own stamp says which weights made them: a rank replaced since its replica's
            # last refit holds the weights it started with, whatever the group recorded.
            made = int(rows.batch[VERSION_COLUMN][0])
            if made != self.rollout.weight_versions[i]:
                self.rollout.record_weight_version(i, made)
            self.buffer.put(rows, version=made, block=False)
            self.tally.rows_generated += len(rows)

    def _service(self) -> None:
        """Collect finished rows; set idle replicas generating (refit first when behind) while useful and in budget."""
        self._collect()
        while self.idle and self.next_step < self.steps and self.version >= self.next_step - self.staleness and (
                self.buffer.rows + self.per * (len(self.running) + 1) <= self.rows):
            i = self.idle.pop(0)
            if self.rollout.weight_versions[i] < self.version or i in self.suspect:  # a rolling refit: this replica alone
                self.tally.refit_bytes.append(self._refit(self.views[i]))
                self.suspect.discard(i)
            try:
                self.running[i] = self.views[i].generate_sequences_later(self.chunks[i])
            except FAULT_ERRORS as err:  # the group recovers on its next call: this replica waits for the next round
                self.idle.append(i)
                self._failed(i, err)
                break
            self.started[i] = time.monotonic()

    def _failed(self, replica: int, err: BaseException) -> None:
        """Count a generation that failed; its replica is refit before it generates again."""
        self.tally.generations_failed += 1
        self.tally.failures.append(str(err).splitlines()[0])
        self.suspect.add(replica)
        logger.warning("rollout replica %d: its generation failed (%s); it is refit and generates again",
                       replica, self.tally.failures[-1])


__all__ = ["AsyncRollout", "AsyncTally"]
