"""Start-up of a Ray worker group, stage by stage: a progress bar on a terminal and a per-rank report.

A group starts in stages: its bundles are **placed** (the placement groups are ready), each
rank's process is **started** (its host actor was constructed: the process is up and has
imported rankmesh), the worker classes are **imported** (the rank received its setup, which
unpickles the user's classes), the workers are **initialized** (their ``__init__`` returned),
and, for megatron groups, the process groups are **cross-checked** against the mesh.  A rank
reports its own times on its clock; each is shifted onto the controller's by the offset
measured with the first round trip (the midpoint rule: the rank answered between sending and
receiving).  ``wg.startup_report()`` returns the result.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

#: The stages of a group's start, in order.
STAGES = ("placed", "started", "imported", "initialized", "cross-checked")


@dataclass
class StartupReport:
    """Seconds from the group's start to the end of each stage, per rank (``None``: not reached).

    ``controller`` holds the stages the controller alone sees (``placed``, ``cross-checked``);
    ``ranks[r]`` the ones each rank reports, on the controller's clock.
    """

    group: str
    controller: dict[str, float] = field(default_factory=dict)
    ranks: list[dict[str, float]] = field(default_factory=list)
    clock_offsets_s: list[float] = field(default_factory=list)

    def slowest(self, stage: str) -> tuple[int, float] | None:
        """(rank, seconds) of the rank that finished ``stage`` last."""
        times = [(r, t[stage]) for r, t in enumerate(self.ranks) if stage in t]
        return max(times, key=lambda rt: rt[1]) if times else None

    def format(self) -> str:
        lines = [f"start-up of {self.group} ({len(self.ranks)} ranks), seconds since start:"]
        for stage in STAGES:
            if stage in self.controller:
                lines.append(f"  {stage:<13} {self.controller[stage]:7.2f}")
                continue
            done = [t[stage] for t in self.ranks if stage in t]
            if done:
                rank, last = self.slowest(stage) or (0, 0.0)
                lines.append(f"  {stage:<13} first {min(done):7.2f}, last {last:7.2f} (rank {rank})")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "controller": self.controller, "ranks": self.ranks, "clock_offsets_s": self.clock_offsets_s}


class StartupProgress:
    """Times a group's start-up stages; shows a tqdm bar on a terminal unless ``show`` is false.

    ``show=None``: a bar only when stderr is a terminal.
    """

    def __init__(self, group: str, world: int, show: bool | None = None) -> None:
        self.t0 = time.time_ns()
        self.report = StartupReport(group, ranks=[{} for _ in range(world)], clock_offsets_s=[0.0] * world)
        self._offsets_ns = [0] * world
        show = sys.stderr.isatty() if show is None else show
        self._bar = None
        if show:
            from tqdm import tqdm  # noqa: PLC0415 - only for a terminal

            # No rate and no time left: the stages are not alike (placing takes a second, importing
            # megatron-core a minute), so tqdm's estimate from the first ones misleads (9.5 minutes left, read
            # when 32 s were).
            self._bar = tqdm(total=4, desc=f"{group}: starting", file=sys.stderr, leave=False,
                             bar_format="{desc}stage {n_fmt}/{total_fmt} [{elapsed}]")

    def _seconds(self, ns: int) -> float:
        return round((ns - self.t0) / 1e9, 4)

    def controller_stage(self, stage: str) -> None:
        """``stage`` ended now, for the whole group."""
        self.report.controller[stage] = self._seconds(time.time_ns())
        self._advance(stage)

    def clocks(self, sent_ns: int, received_ns: int, worker_now_ns: list[int]) -> None:
        """Measure each rank's clock offset from one round trip (sent, answered, received)."""
        middle = (sent_ns + received_ns) // 2
        self._offsets_ns = [now - middle for now in worker_now_ns]
        self.report.clock_offsets_s = [o / 1e9 for o in self._offsets_ns]

    def rank_stage(self, stage: str, worker_ns: list[int]) -> None:
        """``stage`` ended on each rank at ``worker_ns[r]`` (worker clocks)."""
        for r, ns in enumerate(worker_ns):
            self.report.ranks[r][stage] = self._seconds(ns - self._offsets_ns[r])
        self._advance(stage)

    def _advance(self, stage: str) -> None:
        if self._bar is not None:
            self._bar.set_description(f"{self.report.group}: {stage}")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
