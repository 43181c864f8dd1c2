"""Tracing group calls: a per-rank timeline of every dispatch, as Chrome trace-event JSON.

``with rankmesh.trace("out.json"):`` records every group call made in the block;
``with wg.trace("out.json"):`` records one group's calls; ``RANKMESH_TRACE=out.json`` records a
whole program and writes the file at exit.  Open the file in https://ui.perfetto.dev, or read it
with ``rankmesh trace summarize`` and ``rankmesh trace plot``.

A recorder is the group's one call observer (:mod:`.observer`); off by default, an untraced
call reads one attribute.  Building a group installs nothing: ``RANKMESH_TRACE`` is read once,
when the program-wide recorder (:data:`TRACING`) is first asked for: by a group's first call
(or shutdown), or by entering ``rankmesh.trace``; worker processes, which call no group, never
record.

Every name here is loaded with its module on first use (:func:`rankmesh.lazy.lazy_exports`):
worker processes import :mod:`.marks` (what a rank records of a traced call) and nothing of the
recorder, whose process-wide state only the controller needs.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from rankmesh.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers and editors; at run time the names load lazily
    from .chrome import trace_document, write_trace
    from .observer import CallObserver, ObservedCall
    from .recorder import PHASES, RANK_PHASES, TRACE_ENV, TRACING, Recorder, check_trace_path, install, trace
    from .summary import TraceSummary, load_trace, summarize

#: Name -> the module it is loaded from on first use.
NAMES: Mapping[str, str] = MappingProxyType({
    "trace": "rankmesh.tracing.recorder",
    "check_trace_path": "rankmesh.tracing.recorder",
    "PHASES": "rankmesh.tracing.recorder",
    "RANK_PHASES": "rankmesh.tracing.recorder",
    "TRACE_ENV": "rankmesh.tracing.recorder",
    "TRACING": "rankmesh.tracing.recorder",
    "Recorder": "rankmesh.tracing.recorder",
    "install": "rankmesh.tracing.recorder",
    "CallObserver": "rankmesh.tracing.observer",
    "ObservedCall": "rankmesh.tracing.observer",
    "TraceSummary": "rankmesh.tracing.summary",
    "load_trace": "rankmesh.tracing.summary",
    "summarize": "rankmesh.tracing.summary",
    "trace_document": "rankmesh.tracing.chrome",
    "write_trace": "rankmesh.tracing.chrome",
})
__getattr__, __dir__ = lazy_exports(__name__, NAMES, globals())

__all__ = [
    "PHASES",
    "RANK_PHASES",
    "TRACE_ENV",
    "TRACING",
    "CallObserver",
    "ObservedCall",
    "Recorder",
    "TraceSummary",
    "check_trace_path",
    "install",
    "load_trace",
    "summarize",
    "trace",
    "trace_document",
    "write_trace",
]
