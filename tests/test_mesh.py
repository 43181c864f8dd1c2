"""RankMesh against megatron-core's RankGenerator, the oracle.

Expected group lists always come from ``megatron.core.parallel_state.RankGenerator``; rankmesh's
own output is only ever the thing under test.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from rankmesh import DistGlobalInfo, DistRankInfo, MeshError, RankMesh
from rankmesh.mesh import RankGrid

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.parallel_state import RankGenerator

DENSE_ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-pp-dp", "tp-pp-dp-cp", "pp-dp-cp-tp", "dp-cp-tp-pp", "cp-tp-dp-pp"]
DENSE_TOKENS = ["tp", "dp", "pp", "cp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-cp", "tp-dp", "pp-dp", "tp-cp-dp-pp"]
EXPERT_TOKENS = ["tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp", "ep-dp"]


def factorizations(n: int, parts: int):
    """Ordered tuples of ``parts`` positive ints with product ``n`` (a test-side enumeration)."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorizations(n // first, parts - 1):
                yield (first, *rest)


#: One question to megatron: (tp, ep, dp, pp, cp, order, token).
Question = tuple[int, int, int, int, int, str, str]
#: megatron's answers so far, by question (see :func:`oracle_ranks` and :func:`ask_megatron_ahead`).
ANSWERS: dict[Question, list[list[int]]] = {}
#: The axes :func:`megatron_coords` reads each rank's coordinates from.
COORD_AXES = ("tp", "cp", "dp", "pp", "ep")
#: Every token the dense test asks about each mesh.
DENSE_QUESTIONS = tuple(dict.fromkeys((*DENSE_TOKENS, *COORD_AXES)))


def oracle_ranks(tp: int, ep: int, dp: int, pp: int, cp: int, order: str, token: str) -> list[list[int]]:
    """megatron's ``RankGenerator(...).get_ranks(token)``, computed once per distinct question.

    The dense and expert tests ask megatron the same questions many times (every ep/etp variant
    of a dense mesh re-asks its pp groups), and megatron's group enumeration is most of their
    time; the answers are megatron's either way.
    """
    question = (tp, ep, dp, pp, cp, order, token)
    if question not in ANSWERS:
        ANSWERS[question] = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order).get_ranks(token)
    return ANSWERS[question]


def _answer(configs: list[tuple[int, int, int, int, int, str]]) -> list[tuple[Question, list[list[int]]]]:
    """Every dense question about each ``(tp, ep, dp, pp, cp, order)``, one RankGenerator per config."""
    answers = []
    for tp, ep, dp, pp, cp, order in configs:
        generator = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
        answers += [((tp, ep, dp, pp, cp, order, token), generator.get_ranks(token)) for token in DENSE_QUESTIONS]
    return answers


@pytest.fixture(scope="module", autouse=True)
def ask_megatron_ahead():
    """Ask megatron the dense test's ~131,000 questions in two forked processes, before the tests.

    megatron's pure-Python enumeration is nearly all of this module's time and uses one core; two
    processes halve it.  The module runs before the session's Ray starts (FORKING_MODULES in
    tests/conftest.py): forking a connected Ray driver would break it, so with Ray up this does
    nothing and the tests ask as they go.
    """
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    configs = [
        (tp, 1, dp, pp, cp, order)
        for world in range(1, 65)
        for tp, cp, dp, pp in factorizations(world, 4)
        for order in DENSE_ORDERS
    ]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        for answers in pool.map(_answer, [configs[0::2], configs[1::2]]):
            ANSWERS.update(answers)


@dataclass(frozen=True)
class Oracle:
    """One megatron ``RankGenerator``'s configuration, asked through :func:`oracle_ranks`."""

    tp: int
    ep: int
    dp: int
    pp: int
    cp: int
    order: str

    def get_ranks(self, token: str) -> list[list[int]]:
        return oracle_ranks(self.tp, self.ep, self.dp, self.pp, self.cp, self.order, token)


def megatron_coords(gen: Oracle, world: int) -> dict[str, list[int]]:
    """Each rank's coordinate on each axis, read off megatron's single-axis groups."""
    coords = {}
    for axis in COORD_AXES:
        table = [0] * world
        for group in gen.get_ranks(axis):
            for index, rank in enumerate(group):
                table[rank] = index
        coords[axis] = table
    return coords


@pytest.mark.parametrize("world", range(1, 65))
def test_dense_groups_match_megatron_for_every_factorization(world):
    checked = 0
    for tp, cp, dp, pp in factorizations(world, 4):
        for order in DENSE_ORDERS:
            oracle = Oracle(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            mesh = RankMesh(tp=tp, pp=pp, cp=cp, dp=dp, order=order)
            assert mesh.world_size == world
            for token in DENSE_TOKENS:
                assert mesh.groups(token) == oracle.get_ranks(token), (tp, cp, dp, pp, order, token)
            expected = megatron_coords(oracle, world)
            table = mesh.coord_table()
            for axis in ("tp", "cp", "dp", "pp"):
                assert table[axis].tolist() == expected[axis]
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16, 24, 32, 64])
def test_expert_groups_match_megatron_expert_generator(world):
    checked = 0
    for order in ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "ep-tp-cp-dp-pp"]:
        for tp, cp, dp, pp in factorizations(world, 4):
            for ep in (1, 2, 4, 8):
                for etp in (None, 1, 2):
                    etp_size = tp if etp is None else etp
                    if world % (etp_size * ep * pp):
                        continue
                    edp = world // (etp_size * ep * pp)
                    if not (order.endswith("pp") or pp == 1 or edp == dp):
                        # megatron-core's initialize_model_parallel asserts here
                        if ep > 1 or etp_size != tp:
                            with pytest.raises(MeshError, match="expert dp size"):
                                RankMesh(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, order=order)
                        else:
                            with pytest.raises(MeshError, match="expert dp size"):
                                RankMesh(tp=tp, pp=pp, cp=cp, dp=dp, order=order).check_megatron()
                        continue
                    oracle = Oracle(tp=etp_size, ep=ep, dp=edp, pp=pp, cp=1, order=order)
                    dense_oracle = Oracle(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
                    mesh = RankMesh(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, order=order)
                    for token in EXPERT_TOKENS:
                        assert mesh.groups(token, expert=True) == oracle.get_ranks(token), (
                            tp, cp, dp, pp, ep, etp, order, token)
                    # megatron asserts the pp groups agree between the two generators
                    assert mesh.groups("pp") == dense_oracle.get_ranks("pp") == oracle.get_ranks("pp")
                    expected = megatron_coords(oracle, world)
                    info = [mesh.coords(r) for r in range(world)]
                    assert [i.ep_rank for i in info] == expected["ep"]
                    assert [i.etp_rank for i in info] == expected["tp"]
                    assert [i.edp_rank for i in info] == expected["dp"]
                    checked += 1
    assert checked > 0


def test_coords_and_rank_of_on_hand_derived_table():
    # tp2 pp2 dp2, default order tp-cp-ep-dp-pp: rank = tp + 2*dp + 4*pp (derived by hand)
    mesh = RankMesh(tp=2, pp=2, dp=2)
    expected = {
        0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0),
        4: (0, 0, 1), 5: (1, 0, 1), 6: (0, 1, 1), 7: (1, 1, 1),
    }
    for rank, (tp, dp, pp) in expected.items():
        assert mesh.coords(rank) == DistRankInfo(tp_rank=tp, dp_rank=dp, pp_rank=pp, cp_rank=0, etp_rank=tp, edp_rank=dp)
        assert mesh.rank_of(tp=tp, dp=dp, pp=pp) == rank
    assert mesh.collect_ranks() == [4, 6]
    assert [r for r in range(8) if mesh.is_collect(r)] == [4, 6]
    assert mesh.first_stage_ranks() == [0, 1, 2, 3]
    assert mesh.last_stage_ranks() == [4, 5, 6, 7]
    assert mesh.is_first_stage(3) and mesh.is_last_stage(7) and not mesh.is_last_stage(0)
    assert mesh.global_info == DistGlobalInfo(tp_size=2, dp_size=2, pp_size=2, cp_size=1, ep_size=1, etp_size=2, edp_size=2)
    assert mesh.group_of(5, "tp") == [4, 5]
    assert mesh.group_of(5, "dp") == [5, 7]
    assert mesh.group_of(5, "pp") == [1, 5]


def test_collect_and_dp_rank_with_cp():
    # tp2 cp2 dp2 pp2: rank = tp + 2*cp + 4*dp + 8*pp
    mesh = RankMesh(tp=2, cp=2, dp=2, pp=2)
    assert mesh.collect_ranks() == [8, 12]
    assert [r for r in range(16) if mesh.is_collect(r)] == [8, 12]
    # dp-cp group of rank 6 (tp0 cp1 dp1 pp0): ranks with tp0 pp0 -> [0, 2, 4, 6]
    assert mesh.group_of(6, "dp-cp") == [0, 2, 4, 6]
    assert mesh.dp_rank(6) == 1
    assert mesh.dp_rank(6, with_cp=True) == 3


def test_for_world_derives_dp():
    mesh = RankMesh.for_world(16, tp=2, pp=2)
    assert mesh.size("dp") == 4 and mesh.world_size == 16
    with pytest.raises(MeshError, match="not divisible"):
        RankMesh.for_world(12, tp=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, "tp must be a positive integer"),
        ({"dp": -2}, "dp must be a positive integer"),
        ({"pp": 1.5}, "pp must be a positive integer"),
        ({"cp": "2"}, "cp must be a positive integer"),
        ({"tp": True}, "tp must be a positive integer"),
        ({"tp": 2, "order": "tp-xx-dp"}, "unknown axis 'xx'"),
        ({"tp": 2, "order": "tp-dp-tp"}, "appears twice"),
        ({"tp": 2, "pp": 2, "order": "tp-dp"}, "leaves out axis 'pp'"),
        ({"tp": 2, "order": ""}, "order must be a string"),
        ({"tp": 3, "dp": 2, "ep": 4}, "not divisible by etp\\*ep\\*pp"),
    ],
)
def test_bad_mesh_arguments_name_the_argument(kwargs, message):
    with pytest.raises(MeshError, match=message):
        RankMesh(**kwargs)


def test_cp_and_ep_in_one_grid_refused_but_allowed_across_views():
    with pytest.raises(MeshError, match="cannot both exceed 1"):
        RankGrid(cp=2, ep=2)
    mesh = RankMesh(tp=1, cp=2, dp=2, ep=4)  # as megatron: cp in the dense view, ep in the expert view
    assert mesh.groups("ep", expert=True) == RankGenerator(tp=1, ep=4, dp=1, pp=1, cp=1, order="tp-cp-ep-dp-pp").get_ranks("ep")
    with pytest.raises(MeshError, match="expert view"):
        mesh.groups("ep")


def test_rank_out_of_range_and_bad_tokens():
    mesh = RankMesh(tp=2, dp=2)
    for bad in (-1, 4, 100):
        with pytest.raises(MeshError, match=f"rank {bad} is out of range"):
            mesh.coords(bad)
    with pytest.raises(MeshError, match="unknown axis 'zz'"):
        mesh.groups("tp-zz")
    with pytest.raises(MeshError, match="tp=2 is out of range"):
        mesh.rank_of(tp=2)


def test_mesh_pickles_and_compares():
    import pickle

    mesh = RankMesh(tp=2, pp=2, dp=2, ep=2, etp=1, order="tp-cp-ep-dp-pp")
    again = pickle.loads(pickle.dumps(mesh))
    assert again == mesh and hash(again) == hash(mesh)
    assert again.groups("ep", expert=True) == mesh.groups("ep", expert=True)
    assert RankMesh(tp=2, dp=2) != RankMesh(tp=2, dp=2, order="dp-tp")


def test_large_mesh_is_vectorized_and_fast():
    import time

    start = time.perf_counter()
    mesh = RankMesh.for_world(131072, tp=8, pp=8, cp=2)
    table = mesh.coord_table()
    groups = mesh.groups("dp")
    elapsed = time.perf_counter() - start
    assert len(groups) == 8 * 8 * 2 and len(groups[0]) == 131072 // 128
    # spot-check against the megatron formula for the default order: rank = tp + 8cp + 16dp + 16*1024 pp
    rank = 3 + 8 * 1 + 16 * 17 + 16 * 1024 * 5
    assert (table["tp"][rank], table["cp"][rank], table["dp"][rank], table["pp"][rank]) == (3, 1, 17, 5)
    assert elapsed < 5.0  # generous bound on a shared machine; scripts/bench_mesh.py prints the figure
