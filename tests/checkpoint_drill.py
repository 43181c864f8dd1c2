"""Resume on another mesh: train the actor, checkpoint it, resume on a chain of other meshes, compare with the run that never stopped.

Shared by ``tests/test_checkpoint_megatron.py`` (4 ranks) and the fault drill
(:func:`resume_on_another_mesh`, 8 ranks: tp2·pp2·dp2 -> tp1·pp2·dp4 -> tp4·dp2).

The expected values come from the uninterrupted run on the first mesh, never from the
checkpoint code: the chain must end where that run ends, within :data:`RTOL` and :data:`ATOL`.
Every mesh's group is built in the same processes (a :class:`tests.hosts.HostBank`'s, through
:class:`MeshHosts`): a megatron process costs 4-5 CPU-seconds to start, a new group in running
processes well under one.

Why the tolerance is torch's own for float32 (``torch.testing.assert_close``: rtol 1.3e-6,
atol 1e-5): a checkpoint round trip on the *same* mesh is bit-exact (0.0 measured), so what is
left is the new mesh's arithmetic.  A tp change reorders float32 sums (the row-parallel matmuls'
partial sums, the vocab-parallel softmax, the dp gradient mean), so gradients differ in their last
bits; where terms cancel, an element's relative error reaches ~1e-5, and Adam turns it into a
weight error of about lr x that (its step is ~lr whatever the gradient's size).  Measured with
lr 1e-2: at most 4.1e-7 absolute on 4 ranks (one step per mesh) and 5.8e-7 on 8 ranks (two), up
to 1.6e-6 of the largest entry of a small tensor (a bias of ~0.02): 3-6 % of the tolerance.  A
run whose Adam moments were lost instead deviates by 1.7-3.5e-2, 1700-3500 times the tolerance.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from rankmesh.backends.ray import RayClassWithInitArgs, RayWorkerGroup
from rankmesh.data import DataProto
from rankmesh.megatron.reference import TinyConfig
from rankmesh.megatron.roles import ActorWorker
from rankmesh.mesh import RankMesh
from tests.hosts import HostBank

logger = logging.getLogger(__name__)

#: The tolerance of a resumed run against the uninterrupted one: ``|got - want| <= ATOL + RTOL * |want|``
#: per element, torch.testing.assert_close's float32 defaults (module docstring).
RTOL, ATOL = 1.3e-6, 1e-5
#: Adam's learning rate: large enough that lost moments show after one step.
LR = 1e-2
#: Rows per training step (divisible by every dp size of the chains).
ROWS = 8


def batch(step: int, rows: int = ROWS) -> DataProto:
    """The PPO batch of training step ``step`` (the same on every mesh)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, TinyConfig().vocab_size, (rows, 8), generator=gen)
    return DataProto.from_dict(
        {"input_ids": ids, "old_log_probs": torch.full((rows, 5), -4.0), "advantages": torch.randn(rows, 5, generator=gen)},
        meta_info={"prompt_length": 3},
    )


def full_weights(wg: Any) -> dict[str, np.ndarray]:
    """Every weight of the model, tp-gathered, from dp replica 0's pipeline stages."""
    out: dict[str, np.ndarray] = {}
    for piece in wg.gather_full_weights():
        if piece is not None and piece["dp"] == 0:
            out.update(piece["weights"])
    return out


@dataclass(frozen=True)
class Deviation:
    """How far a run's weights are from the expected ones.

    ``ratio``: the largest ``|got - want| / (ATOL + RTOL * |want|)``, at most 1 within the
    tolerance; ``max_abs``: the largest absolute difference; ``relative``: the largest
    ``max|got - want| / max|want|`` of a tensor; ``tensor``: where ``ratio`` is largest.
    """

    ratio: float
    max_abs: float
    relative: float
    tensor: str

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def deviation(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> Deviation:
    """``got`` against ``want`` (same tensor names), elementwise."""
    if sorted(got) != sorted(want):
        raise AssertionError(f"the runs hold different tensors: {sorted(set(got) ^ set(want))}")
    ratios = {k: float((np.abs(got[k] - want[k]) / (ATOL + RTOL * np.abs(want[k]))).max()) for k in want}
    worst = max(ratios, key=ratios.__getitem__)
    return Deviation(
        ratio=ratios[worst],
        max_abs=max(float(np.abs(got[k] - want[k]).max()) for k in want),
        relative=max(float(np.abs(got[k] - want[k]).max() / max(np.abs(want[k]).max(), 1e-30)) for k in want),
        tensor=worst,
    )


class MeshHosts:
    """Groups of :class:`ActorWorker` built for one mesh after another in a host bank's processes."""

    def __init__(self, bank: HostBank) -> None:
        self.bank = bank
        self.group: RayWorkerGroup | None = None

    def build(self, mesh: RankMesh, model: dict | None = None) -> RayWorkerGroup:
        """A fresh actor group over ``mesh`` (the previous group's workers and process groups are dropped)."""
        self.drop()
        init = RayClassWithInitArgs(ActorWorker, model=model or TinyConfig().to_dict(), lr=LR, micro_batches=1)
        self.group = self.bank.build(init, mesh)
        return self.group

    def drop(self) -> None:
        """Release the current group's parallel_state and give its processes back to the bank."""
        if self.group is None:
            return
        self.group.destroy_megatron()
        self.bank.give_back(self.group)
        self.group = None


@dataclass
class ChainResult:
    """What :func:`run_chain` measured: one entry per hop (mesh i-1 -> mesh i)."""

    meshes: list[str]
    deviations: list[Deviation] = field(default_factory=list)  # vs the uninterrupted run after the hop's steps
    save_s: list[float] = field(default_factory=list)  # slowest rank, per checkpoint written
    load_s: list[float] = field(default_factory=list)  # slowest rank, per checkpoint read
    fresh_deviation: Deviation | None = None  # last hop with reset optimizers (weights only)
    versions: list[int] = field(default_factory=list)  # weight version each load reported


def train(wg: Any, steps: range) -> None:
    """One PPO update of the actor group per step of ``steps`` (each step's own batch)."""
    for step in steps:
        wg.update_actor(batch(step))


def run_chain(hosts: MeshHosts, meshes: Sequence[RankMesh], directory: Path, steps: int = 1,
              fresh_check: bool = True) -> ChainResult:
    """Train ``steps`` steps per mesh, checkpointing at each change of mesh; compare with one uninterrupted run.

    The uninterrupted run trains on ``meshes[0]`` throughout and writes the chain's first
    checkpoint.  Hop i loads the previous hop's checkpoint on ``meshes[i]``, trains its steps and
    saves for the next hop.  With ``fresh_check`` the last hop is also run once from the weights
    alone (reset optimizers), to show that restoring Adam's state matters.
    """
    result = ChainResult([str(m) for m in meshes])
    segments = [range(i * steps, (i + 1) * steps) for i in range(len(meshes))]
    wg = hosts.build(meshes[0])
    expected = []
    for i, segment in enumerate(segments):
        train(wg, segment)
        expected.append(full_weights(wg))
        if i == 0:
            reports = wg.save_checkpoint(str(directory / "hop0"), weight_version=segment.stop)
            result.save_s.append(max(r.seconds for r in reports))
    for i in range(1, len(meshes)):
        wg = hosts.build(meshes[i])
        source = str(directory / f"hop{i - 1}")
        if fresh_check and i == len(meshes) - 1:
            wg.load_checkpoint(source, optimizers=False)
            train(wg, segments[i])
            result.fresh_deviation = deviation(full_weights(wg), expected[i])
        reports = wg.load_checkpoint(source)
        result.load_s.append(max(r.seconds for r in reports))
        result.versions.append(reports[0].weight_version)
        train(wg, segments[i])
        result.deviations.append(deviation(full_weights(wg), expected[i]))
        if i < len(meshes) - 1:
            reports = wg.save_checkpoint(str(directory / f"hop{i}"), weight_version=segments[i].stop)
            result.save_s.append(max(r.seconds for r in reports))
        logger.info("hop %s -> %s: %s", meshes[i - 1], meshes[i], result.deviations[-1])
    return result


def resume_on_another_mesh(
    meshes: Sequence[tuple[int, int, int]] = ((2, 2, 2), (1, 2, 4), (4, 1, 2)), steps: int = 2
) -> dict[str, Any]:
    """The fault drill's check: the 8-rank chain tp·pp·dp = ``meshes``, resumed from checkpoints, against the uninterrupted run.

    Returns whether it passed (``ok``: every hop within :data:`RTOL`/:data:`ATOL`, and reset
    optimizers detected), the largest deviations, each hop's, the one with reset optimizers, the
    slowest rank's save and load times and the total seconds.  Starts a local Ray if this process
    is not a Ray driver yet.
    """
    from rankmesh.backends.ray.runtime import ensure_ray

    start = time.perf_counter()
    mesh_list = [RankMesh(tp=tp, pp=pp, dp=dp) for tp, pp, dp in meshes]
    worlds = {m.world_size for m in mesh_list}
    if len(worlds) != 1:
        raise ValueError(f"every mesh of the chain needs the same number of ranks, got {sorted(worlds)}")
    world = worlds.pop()
    # Used only if this process is no Ray driver yet: one logical CPU per rank, whatever the machine has.
    ensure_ray(num_cpus=max(16, world), object_store_memory=512 << 20)
    directory = Path(tempfile.mkdtemp(prefix="rankmesh-ckpt-"))
    bank = HostBank()
    hosts = MeshHosts(bank)
    try:
        chain = run_chain(hosts, mesh_list, directory, steps=steps)
    finally:
        hosts.drop()
        bank.close()
        shutil.rmtree(directory, ignore_errors=True)
    fresh = chain.fresh_deviation
    return {
        "meshes": chain.meshes,
        "ok": all(d.ok for d in chain.deviations) and fresh is not None and fresh.ratio > 100,
        "max_abs_deviation": max(d.max_abs for d in chain.deviations),
        "max_relative_deviation": max(d.relative for d in chain.deviations),
        "tolerance_used": max(d.ratio for d in chain.deviations),  # <= 1 passes
        "tolerance": {"rtol": RTOL, "atol": ATOL},
        "hops": [asdict(d) for d in chain.deviations],
        "fresh_optimizer": asdict(fresh) if fresh is not None else None,
        "save_s": chain.save_s,
        "load_s": chain.load_s,
        "total_s": time.perf_counter() - start,
    }


if __name__ == "__main__":
    import json

    logging.basicConfig(level=logging.INFO)
    print(json.dumps(resume_on_another_mesh(), indent=2))
