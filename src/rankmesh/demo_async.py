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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankmesh.data import DataProto
from rankmesh.data.buffer import RowBuffer
from rankmesh.futures import wait


@dataclass
class AsyncTally:
    """What the asynchronous rollout did: rows made, trained on and dropped, refits, the worst lag."""

    staleness: int
    rows_generated: int = 0
    rows_trained: int = 0
    rows_dropped: int = 0
    rows_left: int = 0  # made but neither trained on nor dropped when the run ended
    max_lag: int = 0  # versions the oldest row trained on lagged the weights it updated, at worst
    lags: list[int] = field(default_factory=list)
    refit_bytes: list[int] = field(default_factory=list)  # one per rolling refit


class AsyncRollout:
    """The rollout's replicas generating on their own for a trainer that takes one batch per step.

    ``steps``: how many batches the trainer will take (no replica generates for a step beyond).
    ``refit(view)`` refits one replica view from the actor and returns the bytes it moved (the
    demo's ``reshard`` with the view's plan).  ``version`` is the actor's weight version (updates
    done); the controller raises it with :meth:`updated` after each update.
    """

    def __init__(self, rollout: Any, prompts: DataProto, staleness: int, steps: int, refit: Any) -> None:
        self.rollout, self.staleness, self.steps, self._refit = rollout, staleness, steps, refit
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
            wait(list(self.running.values()))
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
        if self.running:
            wait(list(self.running.values()), num_returns=len(self.running))
        self._collect()
        self.tally.rows_dropped = self.buffer.dropped_rows
        self.tally.rows_left = self.buffer.rows
        return self.tally

    def _collect(self) -> None:
        """Put the rows of every finished generation into the buffer, with the version that made them."""
        if not self.running:
            return
        done, _ = wait(list(self.running.values()), num_returns=len(self.running), timeout=0)
        for i, fut in list(self.running.items()):
            if fut in done:
                self.buffer.put(self.running.pop(i), version=self.rollout.weight_versions[i], block=False)
                self.idle.append(i)

    def _service(self) -> None:
        """Collect finished rows; set idle replicas generating (refit first when behind) while useful and in budget."""
        self._collect()
        while self.idle and self.next_step < self.steps and self.version >= self.next_step - self.staleness and (
                self.buffer.rows + self.per * (len(self.running) + 1) <= self.rows):
            i = self.idle.pop(0)
            if self.rollout.weight_versions[i] < self.version:  # a rolling refit: this replica alone
                self.tally.refit_bytes.append(self._refit(self.views[i]))
            self.running[i] = self.views[i].generate_sequences_later(self.chunks[i])
            self.tally.rows_generated += self.per


__all__ = ["AsyncRollout", "AsyncTally"]
