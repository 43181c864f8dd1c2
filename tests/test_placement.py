"""Placement of ranks onto nodes, and groups that cross node boundaries (hand-derived tables)."""

from __future__ import annotations

import pytest

from rankmesh import Placement, RankMesh
from rankmesh.errors import PlacementError


def test_uniform_and_heterogeneous_nodes():
    placement = Placement([4, 2, 2])
    assert [placement.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [placement.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert placement.place(5).local_world_size == 2
    assert Placement.uniform(2, 4).process_on_nodes == (4, 4)


def test_tp8_pp4_on_4x8_keeps_tp_inside_nodes():
    mesh = RankMesh(tp=8, pp=4)  # rank = tp + 8*pp: each tp group is one whole node
    assert Placement.uniform(4, 8).spanning_groups(mesh) == []


def test_tp_group_across_nodes_is_reported():
    # tp4 on nodes of 2: tp groups [0..3] and [4..7] each span two nodes
    mesh = RankMesh(tp=4, dp=2)
    spans = Placement.uniform(4, 2).spanning_groups(mesh, tokens=("tp",))
    assert [(s.token, s.ranks, s.nodes) for s in spans] == [("tp", (0, 1, 2, 3), (0, 1)), ("tp", (4, 5, 6, 7), (2, 3))]
    assert "spans nodes [0, 1]" in spans[0].describe()


def test_expert_groups_checked_in_expert_view():
    # ep4, etp1, tp2, dp4 on 2 nodes of 4: expert order tp-ep-dp -> ep groups are [0,1,2,3], [4,5,6,7]
    mesh = RankMesh(tp=2, dp=4, ep=4, etp=1)
    assert Placement.uniform(2, 4).spanning_groups(mesh, tokens=("ep",)) == []
    # with nodes of 2, each ep group spans two nodes
    spans = Placement.uniform(4, 2).spanning_groups(mesh, tokens=("ep",))
    assert [s.ranks for s in spans] == [(0, 1, 2, 3), (4, 5, 6, 7)] and all(s.expert for s in spans)


@pytest.mark.parametrize("bad", [[], [4, 0], [2, -1], "44", [1.5], None])
def test_bad_process_counts(bad):
    with pytest.raises(PlacementError):
        Placement(bad)


def test_mesh_must_fit_placement():
    with pytest.raises(PlacementError, match="has 8 ranks but the nodes hold 6"):
        Placement([4, 2]).spanning_groups(RankMesh(tp=2, dp=4))
    with pytest.raises(PlacementError, match="rank 6 is out of range"):
        Placement([4, 2]).node_of(6)
