"""Tracing group calls: a per-rank timeline of every dispatch, as Chrome trace-event JSON.

``with rankmesh.trace("out.json"):`` records every group call made in the block;
``RANKMESH_TRACE=out.json`` records a whole program (installed when its first group is built,
written at exit).  Open the file in https://ui.perfetto.dev, or read it with ``rankmesh trace
summarize`` and ``rankmesh trace plot``.  Off by default: an untraced call reads one attribute.
"""

from __future__ import annotations

import atexit
import logging
import os
from contextlib import contextmanager
from typing import Iterator

from .chrome import trace_document, write_trace
from .recorder import PHASES, RANK_PHASES, TRACE_ENV, TRACING, Recorder, install
from .summary import TraceSummary, load_trace, summarize

logger = logging.getLogger(__name__)

__all__ = [
    "PHASES",
    "RANK_PHASES",
    "TRACE_ENV",
    "TRACING",
    "Recorder",
    "TraceSummary",
    "install",
    "install_from_env",
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
    summarize``/``plot`` read it too.
    """
    recorder = Recorder(path)
    previous = install(recorder)
    try:
        yield recorder
    finally:
        install(previous)
        write_trace(recorder, path)


def install_from_env() -> Recorder | None:
    """Install a recorder writing to ``$RANKMESH_TRACE`` at exit, when that variable is set.

    Called when a worker group is built (so worker processes, which build none, never record).
    """
    path = os.environ.get(TRACE_ENV)
    if not path or TRACING.recorder is not None:
        return TRACING.recorder
    recorder = Recorder(path)
    install(recorder)

    def write_at_exit() -> None:
        try:
            logger.info("rankmesh trace written to %s", write_trace(recorder, path))
        except Exception:  # pragma: no cover - best effort at exit
            logger.exception("could not write the rankmesh trace to %s", path)

    atexit.register(write_at_exit)
    return recorder
