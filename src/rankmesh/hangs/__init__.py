"""Hang localization: where each unfinished rank of a call is stuck, and one report for all of them.

A call that runs past its timeout (or past ``stall_warn_s``) asks every unfinished rank's process,
while the call is still blocked there, what each of its threads is doing:
:func:`~.capture.capture_process` runs in that process (the Ray host answers it from a separate
thread) and :mod:`.report` groups the answers of many ranks into one text, the ranks stuck at the
same place together.  Nothing here imports Ray or torch: the Ray backend does the asking
(:mod:`rankmesh.backends.ray.hangs`).
"""

from .capture import Collective, Frame, ProcessStacks, ThreadStack, capture_process, name_group
from .report import HangReport, RankHang, group_by_place

__all__ = [
    "Collective",
    "Frame",
    "HangReport",
    "ProcessStacks",
    "RankHang",
    "ThreadStack",
    "capture_process",
    "group_by_place",
    "name_group",
]
