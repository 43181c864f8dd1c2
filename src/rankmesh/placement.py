"""Placing a mesh's ranks onto nodes: which node and local rank each global rank gets.

Ranks fill nodes in order (node 0 takes the first ``process_on_nodes[0]`` ranks, and so on), which
is how a Ray resource pool hands out bundles and how ``torchrun`` numbers ranks.  The point of this
module is to say, before anything is launched, which communication groups would cross a node
boundary: a tp group that spans nodes runs its all-reduces over the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rankmesh.errors import PlacementError
from rankmesh.mesh import RankMesh
from rankmesh.validate import is_int, positive_int

INTRA_NODE_TOKENS: tuple[str, ...] = ("tp", "cp", "ep")
"""Groups that should stay inside a node: their collectives run on every layer."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs."""

    rank: int
    node: int
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class SpanningGroup:
    """A communication group whose members sit on more than one node."""

    token: str
    expert: bool
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]

    def describe(self) -> str:
        view = "expert " if self.expert else ""
        return f"{view}{self.token} group {list(self.ranks)} spans nodes {list(self.nodes)}"


class Placement:
    """Ranks laid onto nodes: ``Placement([4, 4])`` puts ranks 0-3 on node 0 and 4-7 on node 1."""

    def __init__(self, process_on_nodes: Sequence[int]) -> None:
        if isinstance(process_on_nodes, (str, bytes)) or not isinstance(process_on_nodes, Sequence) or not process_on_nodes:
            raise PlacementError(f"process_on_nodes must be a non-empty list of process counts, got {process_on_nodes!r}")
        counts = [
            positive_int(count, f"process_on_nodes[{node}]", PlacementError) for node, count in enumerate(process_on_nodes)
        ]
        self.process_on_nodes: tuple[int, ...] = tuple(counts)
        self.world_size = sum(counts)
        self._node = np.repeat(np.arange(len(counts)), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._local = np.arange(self.world_size) - starts[self._node]

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int) -> "Placement":
        """``nodes`` nodes with ``devices_per_node`` processes each."""
        nodes = positive_int(nodes, "nodes", PlacementError)
        return cls([positive_int(devices_per_node, "devices_per_node", PlacementError)] * nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.process_on_nodes)

    def __repr__(self) -> str:
        return f"Placement(process_on_nodes={list(self.process_on_nodes)})"

    def _check(self, rank: int) -> int:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise PlacementError(f"rank {rank!r} is out of range for {self.world_size} placed processes")
        return int(rank)

    def node_of(self, rank: int) -> int:
        return int(self._node[self._check(rank)])

    def local_rank(self, rank: int) -> int:
        return int(self._local[self._check(rank)])

    def place(self, rank: int) -> RankPlace:
        rank = self._check(rank)
        node = int(self._node[rank])
        return RankPlace(rank, node, int(self._local[rank]), self.process_on_nodes[node])

    def places(self) -> list[RankPlace]:
        return [self.place(r) for r in range(self.world_size)]

    def node_array(self) -> np.ndarray:
        """Node index of every rank (a copy)."""
        return self._node.copy()

    def check_fits(self, mesh: RankMesh) -> None:
        if mesh.world_size != self.world_size:
            raise PlacementError(
                f"mesh {mesh!r} has {mesh.world_size} ranks but the nodes hold {self.world_size} "
                f"processes ({list(self.process_on_nodes)})"
            )

    def spanning_groups(self, mesh: RankMesh, tokens: Sequence[str] = INTRA_NODE_TOKENS) -> list[SpanningGroup]:
        """Every group of ``tokens`` whose ranks sit on more than one node.

        ``"ep"`` is looked up in the expert view (where it lives); other tokens in the dense mesh.
        """
        self.check_fits(mesh)
        found: list[SpanningGroup] = []
        for token in tokens:
            expert = token == "ep"
            if expert and mesh.size("ep") == 1:
                continue
            table = mesh.groups_array(token, expert=expert)
            nodes = self._node[table]
            crossing = np.nonzero(nodes.min(axis=1) != nodes.max(axis=1))[0]
            for row in crossing:
                found.append(
                    SpanningGroup(
                        token=token,
                        expert=expert,
                        ranks=tuple(table[row].tolist()),
                        nodes=tuple(sorted(set(nodes[row].tolist()))),
                    )
                )
        return found
