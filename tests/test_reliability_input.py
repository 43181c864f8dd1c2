"""Bad input and data integrity, property-based, on the in-process backend.

Every malformed call must raise a RankMeshError subclass, or give a correct result; the input is
snapshotted deeply before the call and must be unchanged after it; what comes back must be
exactly the rows sent (NaN, inf, object columns, zero-width and large tensors included).
The same properties run on Ray in ``test_reliability_failures.py``.
"""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import DataProto, DataProtoFuture
from rankmesh.errors import DataProtoError, DispatchError, PaddingError, RankMeshError
from rankmesh.mesh import RankMesh
from tests.reliability_workers import ProtoEcho

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MESHES = [RankMesh(dp=1), RankMesh(dp=2), RankMesh(dp=3), RankMesh(tp=2, dp=2), RankMesh(tp=2, pp=2, dp=2)]
_GROUPS: dict[RankMesh, LocalWorkerGroup] = {}


def group(mesh: RankMesh) -> LocalWorkerGroup:
    if mesh not in _GROUPS:
        _GROUPS[mesh] = LocalWorkerGroup(ProtoEcho, mesh=mesh)
    return _GROUPS[mesh]


# ----- fingerprints: exact, NaN-aware, deep ------------------------------------------------------


def fingerprint(data: DataProto) -> tuple:
    """Everything a DataProto holds, as bytes: equal fingerprints mean identical data."""
    tensors = {}
    if data.batch is not None:
        for key in sorted(data.batch.keys()):
            t = data.batch[key]
            tensors[key] = (str(t.dtype), tuple(t.shape), t.contiguous().numpy().tobytes())
    columns = {k: pickle.dumps(np.asarray(v).tolist()) for k, v in sorted(data.non_tensor_batch.items())}
    return tensors, columns, pickle.dumps(sorted(data.meta_info.items()))


def rows_fingerprint(data: DataProto) -> tuple:
    tensors, columns, _ = fingerprint(data)
    return tensors, columns


# ----- strategies ------------------------------------------------------------------------------

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
objects = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def batches(draw, max_rows: int = 12) -> DataProto:
    rows = draw(st.integers(0, max_rows))
    tensors: dict[str, torch.Tensor] = {"x": torch.arange(rows)}
    if draw(st.booleans()):
        tensors["f"] = torch.tensor(draw(st.lists(floats, min_size=rows, max_size=rows)), dtype=torch.float32).reshape(rows)
    if draw(st.booleans()):
        tensors["empty"] = torch.zeros(rows, 0)
    if draw(st.booleans()):
        tensors["wide"] = torch.randn(rows, draw(st.integers(1, 5)), 3, dtype=torch.float64)
    non_tensors = {}
    if draw(st.booleans()):
        col = np.empty(rows, dtype=object)
        col[:] = draw(st.lists(objects, min_size=rows, max_size=rows)) if rows else []
        non_tensors["obj"] = col
        if draw(st.booleans()):  # a batch of object columns only
            tensors = {}
    meta = {"step": draw(st.integers(0, 3)), "note": draw(st.one_of(st.none(), st.text(max_size=4), floats))}
    return DataProto.from_dict(tensors, non_tensors, meta)


def same_meta(a: dict, b: dict) -> bool:
    def norm(v: Any) -> Any:
        return "nan" if isinstance(v, float) and math.isnan(v) else v

    return {k: norm(v) for k, v in a.items()} == {k: norm(v) for k, v in b.items()}


# ----- round trips -------------------------------------------------------------------------------

METHODS = ["echo", "echo_pad", "echo_pad_nb", "mega_pad", "mega_nb", "pp_as_dp_pad"]


@SETTINGS
@given(data=batches(), mesh=st.sampled_from(MESHES), method=st.sampled_from(METHODS))
def test_round_trip_is_exact_or_a_clear_error(data, mesh, method):
    wg = group(mesh)
    before = fingerprint(data)
    snapshot = copy.deepcopy(data)
    try:
        out = getattr(wg, method)(data)
        if isinstance(out, DataProtoFuture):
            assert len(out) == len(data)
            out = out.get()
    except PaddingError:
        assert method in ("echo", "mega_nb") and len(data) % _pieces(wg, method) != 0
    else:
        assert len(out) == len(data)
        assert rows_fingerprint(out) == rows_fingerprint(data)
        assert same_meta(out.meta_info, data.meta_info)
    assert fingerprint(data) == before == fingerprint(snapshot)


def _pieces(wg, method: str) -> int:
    return getattr(wg, method).rankmesh_binding.plan.n_pieces


def test_large_and_zero_size_tensors():
    wg = group(RankMesh(dp=2))
    big = DataProto.from_dict({"big": torch.full((4, 2_000_000), float("nan")), "zero": torch.zeros(4, 0, 7)})
    before = fingerprint(big)
    out = wg.echo(big)
    assert fingerprint(out)[0] == before[0] and fingerprint(big) == before


# ----- malformed input -----------------------------------------------------------------------------

not_protos = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=6),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.just(torch.zeros(4)),
    st.just(np.zeros(4)),
    st.just(object()),
)


@SETTINGS
@given(value=not_protos, mesh=st.sampled_from(MESHES), method=st.sampled_from(METHODS))
def test_wrong_types_raise_dispatch_error(value, mesh, method):
    snapshot = copy.deepcopy(value)
    with pytest.raises(DispatchError):
        getattr(group(mesh), method)(value)
    if isinstance(value, torch.Tensor):
        assert torch.equal(value, snapshot)


@SETTINGS
@given(mesh=st.sampled_from(MESHES), length=st.integers(0, 10), method=st.sampled_from(["per_rank", "per_dp"]))
def test_wrong_list_lengths_raise_dispatch_error(mesh, length, method):
    wg = group(mesh)
    need = _pieces(wg, method)
    items = [[i] for i in range(length)]
    snapshot = copy.deepcopy(items)
    if length == need:
        assert getattr(wg, method)(items) == items
    else:
        with pytest.raises(DispatchError, match=str(need)):
            getattr(wg, method)(items)
    assert items == snapshot


@SETTINGS
@given(a=batches(), b=batches(), mesh=st.sampled_from(MESHES))
def test_mismatched_batch_lengths(a, b, mesh):
    before = (fingerprint(a), fingerprint(b))
    try:
        out = group(mesh).first_of_two(a, b)
    except RankMeshError as exc:
        assert len(a) != len(b) or len(a) % mesh.world_size != 0, exc
        if len(a) != len(b):
            assert isinstance(exc, DispatchError) and "same number of rows" in str(exc)
    else:
        assert len(a) == len(b) and rows_fingerprint(out) == rows_fingerprint(a)
    assert (fingerprint(a), fingerprint(b)) == before


@SETTINGS
@given(n=st.integers(0, 6), m=st.integers(0, 6), bad=st.sampled_from(["list", "int", "scalar", "numpy"]))
def test_malformed_dataproto_construction(n, m, bad):
    if n != m:
        with pytest.raises(DataProtoError, match="rows"):
            DataProto.from_dict({"a": torch.zeros(n), "b": torch.zeros(m)})
    value = {"list": [1.0] * n, "int": n, "scalar": torch.tensor(1.0), "numpy": np.zeros(n)}[bad]
    with pytest.raises(DataProtoError):
        DataProto.from_dict({"a": value})


# ----- in-process failures read like Ray's ----------------------------------------------------------


def test_local_worker_errors_lowest_rank_first_with_others_attached():
    from rankmesh.errors import WorkerError
    from tests.reliability_workers import FaultWorker

    wg = LocalWorkerGroup(FaultWorker, mesh=RankMesh(tp=2, dp=2))
    for call in (lambda: wg.act(["ok", "raise", "ok", "raise"]), lambda: wg.act_nb(["ok", "raise", "ok", "raise"]).get()):
        with pytest.raises(WorkerError) as info:
            call()
        err = info.value
        assert err.rank == 1 and err.coords.tp == 1 and [o.rank for o in err.others] == [3]
        assert err.node == "localhost" and "ValueError: planned failure on rank 1" in err.remote_traceback
        again = pickle.loads(pickle.dumps(err))
        assert (again.rank, again.node, [o.rank for o in again.others]) == (1, "localhost", [3])
    assert wg.with_timeout(5).act(["ok"] * 4) == [0, 1, 2, 3]
