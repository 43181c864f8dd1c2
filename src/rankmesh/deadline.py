"""Deadlines: one end time per call, handed to every wait on its path so that none outlives the call.

Why one object instead of a timeout per wait: a call waits in several places (for the ranks'
earlier calls, for a free ring slot, for its answers, for a parked output), and a timeout given
to each would add up.  A :class:`Deadline` is fixed when the call starts; each wait asks what is
:meth:`~Deadline.left`.  ``Deadline.never()`` (no end) is what a call without a timeout gets;
a wait that must end anyway takes :meth:`Deadline.bounded` (the earlier of the call's end and
its own bound).  Times are ``time.monotonic()`` of the process that made the deadline, so a
deadline does not travel between processes: send :meth:`~Deadline.left` seconds instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """When a call must end (``end``, on ``time.monotonic()``; ``None``: never) and the timeout it came from."""

    end: float | None = None
    seconds: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> "Deadline":
        """``seconds`` from now (``None``: never)."""
        if seconds is None:
            return NEVER
        return cls(time.monotonic() + seconds, seconds)

    @classmethod
    def never(cls) -> "Deadline":
        return NEVER

    @property
    def finite(self) -> bool:
        return self.end is not None

    def left(self) -> float:
        """Seconds left (``math.inf`` without an end; never below 0)."""
        if self.end is None:
            return math.inf
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def within(self, seconds: float) -> float:
        """How long a wait may sleep now: at most ``seconds``, and no later than the end."""
        return min(seconds, self.left())

    def bounded(self, seconds: float) -> "Deadline":
        """This deadline, or ``seconds`` from now if that comes first (or this one has no end)."""
        other = Deadline.after(seconds)
        return other if self.end is None or (other.end or 0.0) < self.end else self

    def timeout(self) -> float | None:
        """Seconds left as a timeout argument (``None`` without an end)."""
        return None if self.end is None else self.left()


NEVER = Deadline()
