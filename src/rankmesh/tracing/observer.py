"""What a worker group tells an observer of its calls: the hooks a trace recorder implements.

A group call has one place where something may watch it.  The group reads its observer once
per call (``wg.trace(path)``'s recorder, else the process's, :data:`.recorder.TRACING`); when
there is none, that read is all tracing costs, and no function of :mod:`rankmesh.tracing` runs.
When there is one, the group asks it for an :class:`ObservedCall` (``begin``) and tells that
object the call's life in order: each controller phase as it ends (``split``, ``put``,
``submit``), every object it ships, how many ranks it sends the call to (the ranks then time
themselves), the outputs it fetched (which carry the ranks' timings), and the end.  The group
knows nothing else of tracing: which phases follow ``submit``, what a rank's timing looks like
and where a non-blocking call's timings wait are the observer's business.

:class:`rankmesh.tracing.recorder.Recorder` is the observer rankmesh ships (``wg.trace`` makes
one the group's own; ``rankmesh.trace`` and ``RANKMESH_TRACE`` the process's).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class ObservedCall(Protocol):
    """One group call as its observer follows it; the group calls these in this order."""

    def phase(self, name: str) -> None:
        """The controller phase ``name`` (``split``, ``put``, ``submit``) ends now."""

    def shipped(self, value: Any) -> None:
        """``value`` was shipped to the ranks once (``executor.share``), during ``put``."""

    def timed(self, ranks: int) -> int:
        """The call goes to ``ranks`` ranks, each asked to time itself (``RankCall.trace``).

        Returns the ``RankCall.keep`` key: 0 when the ranks send their timings back with their
        outputs (a blocking call), else the key they keep them under (a non-blocking call,
        whose outputs travel on inside a future).
        """

    def received(self, outputs: list[Any], ranks: Sequence[int]) -> list[Any]:
        """A blocking call's fetched outputs of ``ranks``: returns them with the ranks' timings taken off."""

    def end(self, result: Any) -> Any:
        """The call returns ``result`` (a blocking call's joined output, or a future); returns it."""


@runtime_checkable
class CallObserver(Protocol):
    """Whatever watches a worker group's calls (a trace recorder)."""

    def begin(self, group: Any, method: str, blocking: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ObservedCall:
        """A call of ``group.method`` starts now, with the arguments the caller gave."""

    def closing(self, group: Any) -> None:
        """``group`` is about to stop its ranks: collect what they still hold for this observer."""
