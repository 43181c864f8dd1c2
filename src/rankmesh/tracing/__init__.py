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
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from .chrome import trace_document, write_trace
from .observer import CallObserver, ObservedCall
from .recorder import PHASES, RANK_PHASES, TRACE_ENV, TRACING, Recorder, install
from .summary import TraceSummary, load_trace, summarize

__all__ = [
    "PHASES",
    "RANK_PHASES",
    "TRACE_ENV",
    "TRACING",
    "CallObserver",
    "ObservedCall",
    "Recorder",
    "TraceSummary",
    "install",
    "load_trace",
    "summarize",
    "trace",
    "trace_document",
    "write_trace",
]


@contextmanager
def trace(path: str | os.PathLike[str]) -> Iterator[Recorder]:
    """Record every group call made in the block; write a Chrome trace to ``path`` when it ends.

    Open the file in https://ui.perfetto.dev or ``chrome://tracing``; ``rankmesh trace
    summarize``/``plot`` read it too.  Inside the block this recorder is the program-wide
    one; the one before it (``RANKMESH_TRACE``'s, say) is back when the block ends.
    """
    recorder = Recorder(path)
    previous = install(recorder)
    try:
        yield recorder
    finally:
        install(previous)
        write_trace(recorder, path)
