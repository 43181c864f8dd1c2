"""Proto dispatch accepts a TensorDict in place of a DataProto (as verl 0.9.1's does): split by
rows, outputs concatenated as a TensorDict.  Every proto mode, on the in-process backend (the split
and join code is the backend-neutral dispatch layer; tests/compat/test_ray.py runs one on Ray).

Mesh tp=2 · dp=2 (rank = dp * 2 + tp, megatron's order with tp fastest): the dp-split modes give
rank r the piece ``r // 2`` and collect tp=0 ranks; the rank-split modes give rank r piece r.
Expected rows are written out by hand.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rankmesh import Dispatch, LocalWorkerGroup, RankMesh, Worker, register
from rankmesh.data import DataProtoConfig
from rankmesh.dispatch import make_nd_compute_dataproto_dispatch_fn


def tagged(td, rank):
    return TensorDict({"x": td["x"] * 10, "rank": torch.full_like(td["x"], rank)}, batch_size=td.batch_size)


class TDWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("nd", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def dp_proto(self, td):
        return tagged(td, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def dp_func(self, func, td):
        return func(td, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def dp_metric(self, td):
        return {"rank": self.rank, "rows": int(td.batch_size[0])}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def mg_proto(self, td):
        return tagged(td, self.rank)

    @register(dispatch_mode=Dispatch.MEGATRON_PP_AS_DP_PROTO)
    def mg_pp_as_dp(self, td):
        return tagged(td, self.rank)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="nd"))
    def nd(self, td):
        return tagged(td, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def dp_async(self, td):
        return tagged(td, self.rank)


@pytest.fixture(scope="module")
def wg():
    return LocalWorkerGroup(TDWorker, mesh=RankMesh(tp=2, dp=2))


def batch(n):
    return TensorDict({"x": torch.arange(float(n))}, batch_size=[n])


def test_rank_split_modes(wg):
    td = batch(8)
    for out in (wg.dp_proto(td), wg.dp_func(tagged, td), wg.dp_async(td).get()):
        assert isinstance(out, TensorDict)
        assert out["x"].tolist() == [float(10 * i) for i in range(8)]
        assert out["rank"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert wg.dp_metric(td) == [{"rank": r, "rows": 2} for r in range(4)]
    assert td["x"].tolist() == [float(i) for i in range(8)], "the caller's TensorDict is unchanged"


@pytest.mark.parametrize("method", ["mg_proto", "mg_pp_as_dp", "nd"])
def test_dp_split_modes_collect_tp0(wg, method):
    out = getattr(wg, method)(batch(4))
    assert isinstance(out, TensorDict)
    assert out["x"].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert out["rank"].tolist() == [0.0, 0.0, 2.0, 2.0]  # dp piece 0 from rank 0, piece 1 from rank 2


def test_uneven_tensordict_is_padded_and_pad_rows_dropped(wg):
    previous = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = True
    try:
        out = wg.dp_proto(batch(6))  # padded to 8: pieces [0,1] [2,3] [4,5] [0,1]
    finally:
        DataProtoConfig.auto_padding = previous
    assert out["x"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert out["rank"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_uneven_tensordict_without_padding_is_refused(wg):
    with pytest.raises(ValueError, match="6 rows does not divide into 4"):
        wg.dp_proto(batch(6))
