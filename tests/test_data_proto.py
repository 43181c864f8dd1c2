"""Unit tests of DataProto: construction, validation, indexing and every operation.

Expected values come from plain torch / numpy computations, never from DataProto itself.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rankmesh.data import (
    AUTO_PADDING_KEY,
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    auto_padding_enabled,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from rankmesh.errors import DataProtoError, PaddingError


def make(n: int = 6, meta: dict | None = None) -> DataProto:
    obs = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    ids = torch.arange(n, dtype=torch.int64) * 10
    names = np.array([f"r{i}" for i in range(n)], dtype=object)
    score = np.arange(n, dtype=np.float64) / 2
    return DataProto.from_dict(
        {"obs": obs, "ids": ids}, {"names": names, "score": score}, meta if meta is not None else {"temp": 1.0}
    )


def snapshot(d: DataProto) -> tuple:
    batch = {k: v.clone() for k, v in d.batch.items()} if d.batch is not None else None
    return batch, copy.deepcopy(d.non_tensor_batch), copy.deepcopy(d.meta_info)


def assert_unchanged(d: DataProto, snap: tuple) -> None:
    batch, nt, meta = snap
    if batch is None:
        assert d.batch is None
    else:
        assert set(d.batch.keys()) == set(batch)
        for k, v in batch.items():
            assert torch.equal(d.batch[k], v), k
    assert set(d.non_tensor_batch) == set(nt)
    for k, v in nt.items():
        assert d.non_tensor_batch[k].dtype == v.dtype and list(d.non_tensor_batch[k]) == list(v), k
    assert d.meta_info == meta


# --- construction and validation -------------------------------------------------------------------


def test_from_dict_lengths_and_list_columns():
    d = DataProto.from_dict({"a": torch.zeros(3, 2)}, {"l": [[1, 2], [3, 4], [5, 6]]})
    assert len(d) == 3
    col = d.non_tensor_batch["l"]
    assert col.dtype == object and col.shape == (3,) and col[1] == [3, 4]


def test_mismatched_tensor_lengths_name_key():
    with pytest.raises(DataProtoError, match=r"'b'.*2 rows.*'a'.*3"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})


def test_mismatched_column_length_names_key():
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['x'\] has 4 rows but batch\['a'\] has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"x": np.zeros(4)})
    with pytest.raises(DataProtoError, match=r"'y'.*1 rows"):
        DataProto(non_tensor_batch={"x": np.zeros(2), "y": np.zeros(1)})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"tensors": {"t": np.zeros(3)}}, "t"),
        ({"tensors": {"t": torch.tensor(1.0)}}, "t"),
        ({"non_tensors": {"n": 5}}, "n"),
        ({"non_tensors": {"n": np.float64(1.0)}}, "n"),
        ({"non_tensors": {"n": torch.zeros(3)}}, "n"),
        ({"non_tensors": {"n": np.array(3)}}, "n"),
    ],
)
def test_wrong_types_name_key(kwargs, key):
    with pytest.raises(DataProtoError, match=repr(key)):
        DataProto.from_dict(**kwargs)


def test_batch_validation():
    with pytest.raises(DataProtoError, match="one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(DataProtoError, match="TensorDict"):
        DataProto(batch={"a": torch.zeros(2)})
    td = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    td.set_non_tensor("flag", 1)
    with pytest.raises(DataProtoError, match="'flag'"):
        DataProto(batch=td)
    with pytest.raises(DataProtoError, match="meta_info"):
        DataProto(meta_info=[1])
    with pytest.raises(DataProtoError, match="str"):
        DataProto(non_tensor_batch={1: np.zeros(2)})


def test_from_single_dict_splits_by_type():
    d = DataProto.from_single_dict({"t": torch.ones(2), "n": np.array(["a", "b"])}, meta_info={"k": 1})
    assert list(d.batch.keys()) == ["t"] and list(d.non_tensor_batch) == ["n"] and d.meta_info == {"k": 1}
    with pytest.raises(DataProtoError, match="'bad'"):
        DataProto.from_single_dict({"bad": [1, 2]})


def test_constructor_does_not_mutate_or_alias_inputs():
    nt = {"l": [1, 2]}
    meta = {"a": 1}
    d = DataProto(non_tensor_batch=nt, meta_info=meta)
    assert nt == {"l": [1, 2]}
    d.meta_info["b"] = 2
    d.non_tensor_batch["x"] = np.zeros(2)
    assert meta == {"a": 1} and set(nt) == {"l"}


def test_len_of_empty_and_column_only():
    assert len(DataProto()) == 0
    assert len(DataProto(non_tensor_batch={"x": np.zeros(4)})) == 4


def test_tensordict_round_trip():
    d = make(4, meta={"m": {"x": 1}})
    td = d.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert torch.equal(back.batch["obs"], d.batch["obs"])
    assert list(back.non_tensor_batch["names"]) == list(d.non_tensor_batch["names"])
    assert back.meta_info == {"m": {"x": 1}}
    assert "names" not in d.batch.keys()  # d untouched


# --- indexing ----------------------------------------------------------------------------------


def test_int_index_returns_item_and_iteration():
    d = make(3)
    item = d[-1]
    assert isinstance(item, DataProtoItem)
    assert torch.equal(item.batch["obs"], torch.tensor([6.0, 7.0, 8.0]))
    assert item.non_tensor_batch["names"] == "r2"
    with pytest.raises(IndexError):
        d[3]
    assert [it.non_tensor_batch["names"] for it in d] == ["r0", "r1", "r2"]


@pytest.mark.parametrize(
    "index",
    [[2, 0], np.array([2, 0]), torch.tensor([2, 0]), [False, False, True, False, False, False], np.array([-4, 0])],
)
def test_index_arrays_and_masks(index):
    d = make(6)
    got = d[index]
    ref = np.arange(6)[np.asarray(index.numpy() if isinstance(index, torch.Tensor) else index)]
    assert torch.equal(got.batch["ids"], torch.from_numpy(ref * 10))
    assert list(got.non_tensor_batch["names"]) == [f"r{i}" for i in ref]


def test_bad_indices():
    d = make(3)
    with pytest.raises(DataProtoError, match="mask"):
        d[[True, False]]
    with pytest.raises(IndexError):
        d[[0, 5]]
    with pytest.raises(DataProtoError):
        d["obs"]
    with pytest.raises(DataProtoError):
        d[np.array([0.5])]
    assert len(d[[]]) == 0


def test_slices_are_views_and_negative_step_copies():
    d = make(6)
    s = d[1:5:2]
    assert torch.equal(s.batch["ids"], torch.tensor([10, 30]))
    assert s.batch["obs"].data_ptr() == d.batch["obs"][1].data_ptr()
    r = d[::-1]
    assert torch.equal(r.batch["ids"], torch.arange(5, -1, -1) * 10)
    assert list(r.non_tensor_batch["names"]) == [f"r{i}" for i in range(5, -1, -1)]


# --- chunk / split / concat ------------------------------------------------------------------


def test_chunk_copies_nothing_and_meta_is_private():
    d = make(6, meta={"temp": 1.0, "nested": {"x": 1}})
    parts = d.chunk(3)
    obs = d.batch["obs"]
    row_bytes = obs.stride(0) * obs.element_size()
    for i, p in enumerate(parts):
        assert p.batch["obs"].data_ptr() == obs.data_ptr() + 2 * i * row_bytes
        assert p.batch["ids"].untyped_storage().data_ptr() == d.batch["ids"].untyped_storage().data_ptr()
        assert np.shares_memory(p.non_tensor_batch["score"], d.non_tensor_batch["score"])
    parts[0].meta_info["temp"] = 5
    parts[0].meta_info["nested"]["x"] = 2
    parts[0].batch.pop("ids")
    assert d.meta_info == {"temp": 1.0, "nested": {"x": 1}} and parts[1].meta_info["nested"] == {"x": 1}
    assert "ids" in d.batch.keys() and "ids" in parts[1].batch.keys()


def test_chunk_requires_divisibility_without_padding():
    d = make(5)
    with pytest.raises(PaddingError, match=r"5 rows into 2"):
        d.chunk(2)
    with pytest.raises(DataProtoError):
        d.chunk(0)
    d.meta_info[AUTO_PADDING_KEY] = True
    assert [len(p) for p in d.chunk(3)] == [2, 2, 1]
    assert [len(p) for p in d.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]


def test_global_auto_padding_switch(monkeypatch):
    d = make(5)
    assert not d.is_padding_enabled()
    monkeypatch.setattr(type(DataProtoConfig), "_auto_padding", False)
    DataProtoConfig.auto_padding = True
    try:
        assert d.padding_enabled() and auto_padding_enabled(d)
        assert [len(p) for p in d.chunk(2)] == [3, 2]
    finally:
        DataProtoConfig.auto_padding = False
    with pytest.raises(TypeError):
        DataProtoConfig.auto_padding = 1
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert DataProtoConfig.auto_padding


def test_split():
    d = make(5)
    parts = d.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert torch.equal(parts[2].batch["ids"], torch.tensor([40]))


def test_concat_values_and_meta_merge(caplog):
    a = make(2, meta={"temp": 1.0, "metrics": {"loss": 1.0}, "rank": 0})
    b = make(3, meta={"temp": 1.0, "metrics": {"loss": 2.0, "acc": 0.5}, "rank": 1})
    with caplog.at_level(logging.DEBUG, logger="rankmesh.data.columns"):
        c = DataProto.concat([a, b])
    assert torch.equal(c.batch["ids"], torch.tensor([0, 10, 0, 10, 20]))
    assert list(c.non_tensor_batch["names"]) == ["r0", "r1", "r0", "r1", "r2"]
    assert c.meta_info == {"temp": 1.0, "metrics": {"loss": [1.0, 2.0], "acc": [0.5]}, "rank": 0}
    assert "rank" in caplog.text
    assert a.meta_info["metrics"] == {"loss": 1.0}
    assert c.batch["obs"].data_ptr() != a.batch["obs"].data_ptr()


def test_concat_errors_and_edges():
    a = make(2)
    with pytest.raises(DataProtoError, match="dtypes"):
        f64 = DataProto.from_dict(
            {"obs": torch.zeros(1, 3, dtype=torch.float64), "ids": torch.zeros(1, dtype=torch.int64)},
            {"names": ["x"], "score": [1.0]},
        )
        DataProto.concat([a, f64])
    with pytest.raises(DataProtoError, match="ids"):
        DataProto.concat([a, a.select(batch_keys=["obs"])])
    with pytest.raises(DataProtoError, match="score"):
        DataProto.concat([a, a.select(non_tensor_batch_keys=["names"])])
    with pytest.raises(DataProtoError, match="part 1"):
        DataProto.concat([a, "x"])
    assert len(DataProto.concat([])) == 0
    assert len(DataProto.concat([a, DataProto(meta_info={"z": 1})])) == 2


# --- union / select / pop / rename -------------------------------------------------------------


def test_union_returns_new_and_checks_conflicts():
    d = make(3)
    a = d.select(batch_keys=["obs"], non_tensor_batch_keys=["names"])
    b = d.select(batch_keys=["ids", "obs"], non_tensor_batch_keys=["score"], meta_info_keys=[])
    snap_a = snapshot(a)
    u = a.union(b)
    assert_unchanged(a, snap_a)
    assert set(u.batch.keys()) == {"obs", "ids"} and set(u.non_tensor_batch) == {"names", "score"}
    other = b.select()
    other.batch["obs"] = other.batch["obs"] + 1
    with pytest.raises(DataProtoError, match="'obs'"):
        a.union(other)
    with pytest.raises(DataProtoError, match="'temp'"):
        a.union(DataProto(meta_info={"temp": 2.0}))
    with pytest.raises(DataProtoError, match="rows"):
        a.union(make(4))


def test_union_nan_values_are_equal():
    x = torch.tensor([float("nan"), 1.0])
    a = DataProto.from_dict({"x": x}, {"n": np.array([np.nan, 1.0]), "o": [float("nan"), "s"]})
    b = DataProto.from_dict({"x": x.clone()}, {"n": np.array([np.nan, 1.0]), "o": [float("nan"), "s"]})
    assert len(a.union(b)) == 2


def test_union_helpers_do_not_mutate():
    t1 = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    t2 = TensorDict({"b": torch.ones(2)}, batch_size=[2])
    u = union_tensor_dict(t1, t2)
    assert set(u.keys()) == {"a", "b"} and set(t1.keys()) == {"a"}
    n1 = {"a": np.zeros(2)}
    assert set(union_numpy_dict(n1, {"b": np.ones(2)})) == {"a", "b"} and set(n1) == {"a"}
    with pytest.raises(DataProtoError, match="'a'"):
        union_numpy_dict(n1, {"a": np.ones(2)})


def test_select_and_deepcopy():
    d = make(3, meta={"temp": 1.0, "x": [1]})
    s = d.select(batch_keys=["obs"], non_tensor_batch_keys=["names"], meta_info_keys=["x"])
    assert list(s.batch.keys()) == ["obs"] and list(s.non_tensor_batch) == ["names"] and s.meta_info == {"x": [1]}
    assert s.batch["obs"].data_ptr() == d.batch["obs"].data_ptr()
    s.meta_info["x"].append(2)
    assert d.meta_info["x"] == [1]
    deep = d.select(deepcopy=True)
    assert deep.batch["obs"].data_ptr() != d.batch["obs"].data_ptr()
    with pytest.raises(DataProtoError, match="'nope'"):
        d.select(batch_keys=["nope"])
    with pytest.raises(DataProtoError, match="'nope'"):
        d.select(non_tensor_batch_keys=["nope"])
    assert len(d.select(batch_keys=[])) == 3


def test_pop_mutates_self_only():
    d = make(3, meta={"temp": 1.0, "k": 2})
    sibling = d[:]
    popped = d.pop(batch_keys=["ids"], non_tensor_batch_keys=["names"], meta_info_keys=["k"])
    assert list(popped.batch.keys()) == ["ids"] and len(popped) == 3
    assert list(popped.non_tensor_batch) == ["names"] and popped.meta_info == {"k": 2}
    assert list(d.batch.keys()) == ["obs"] and list(d.non_tensor_batch) == ["score"] and d.meta_info == {"temp": 1.0}
    assert set(sibling.batch.keys()) == {"obs", "ids"} and "k" in sibling.meta_info
    with pytest.raises(DataProtoError, match="'ids'"):
        d.pop(batch_keys=["ids"])


def test_rename_in_place_with_swap():
    d = make(3)
    ids, obs = d.batch["ids"], d.batch["obs"]
    assert d.rename(["ids", "obs", "names"], ["obs", "ids", "labels"]) is d
    assert d.batch["obs"] is ids and d.batch["ids"] is obs and "labels" in d.non_tensor_batch
    with pytest.raises(DataProtoError, match="'nope'"):
        d.rename("nope", "x")
    with pytest.raises(DataProtoError, match="twice"):
        d.rename("obs", "ids")
    with pytest.raises(DataProtoError):
        d.rename(["obs"], ["a", "b"])


# --- row transforms ------------------------------------------------------------------------------


def test_repeat_interleave_and_tile():
    d = make(3)
    r = d.repeat(2, interleave=True)
    assert torch.equal(r.batch["ids"], torch.tensor([0, 0, 10, 10, 20, 20]))
    assert list(r.non_tensor_batch["names"]) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    t = d.repeat(2, interleave=False)
    assert torch.equal(t.batch["ids"], torch.tensor([0, 10, 20, 0, 10, 20]))
    assert torch.equal(t.batch["obs"][3:], d.batch["obs"])
    assert len(d.repeat(0)) == 0
    with pytest.raises(DataProtoError):
        d.repeat(-1)


def test_sample_level_repeat():
    d = make(3)
    r = d.sample_level_repeat([2, 0, 1])
    assert torch.equal(r.batch["ids"], torch.tensor([0, 0, 20]))
    with pytest.raises(DataProtoError):
        d.sample_level_repeat([1, 1])


def test_reorder_in_place():
    d = make(4)
    d.reorder(torch.tensor([3, 1, 0, 2]))
    assert torch.equal(d.batch["ids"], torch.tensor([30, 10, 0, 20]))
    assert list(d.non_tensor_batch["names"]) == ["r3", "r1", "r0", "r2"]


def test_to_returns_new():
    d = make(2)
    moved = d.to("cpu")
    assert moved is not d and moved.batch is not d.batch
    moved.batch.pop("ids")
    assert "ids" in d.batch.keys()


def test_make_iterator():
    d = make(6)
    batches = list(d.make_iterator(mini_batch_size=2, epochs=2, seed=0, dataloader_kwargs={"shuffle": True}))
    assert len(batches) == 6
    ids = torch.cat([b.batch["ids"] for b in batches[:3]])
    assert sorted(ids.tolist()) == [0, 10, 20, 30, 40, 50]
    with pytest.raises(DataProtoError):
        d.make_iterator(4, 1)


def test_copy_and_deepcopy():
    d = make(3, meta={"m": {"x": 1}})
    c = copy.copy(d)
    assert c.batch["obs"] is d.batch["obs"] and c.batch is not d.batch
    c.meta_info["m"]["x"] = 2
    assert d.meta_info["m"]["x"] == 1
    dc = copy.deepcopy(d)
    dc.batch["obs"].add_(1)
    assert torch.equal(d.batch["obs"], make(3).batch["obs"])


# --- padding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, divisor", [(5, 4), (2, 7), (4, 4), (0, 3), (1, 1)])
def test_pad_and_unpad(n, divisor):
    d = make(n)
    snap = snapshot(d)
    padded, pad = d.pad_to_divisor(divisor)
    assert pad == (divisor - n % divisor) % divisor and len(padded) % divisor == 0
    assert padded is not d
    ref = [i % n for i in range(n + pad)] if n else []
    assert padded.batch["ids"].tolist() == [10 * i for i in ref]
    assert list(padded.non_tensor_batch["names"]) == [f"r{i}" for i in ref]
    back = padded.unpad(pad)
    assert back.batch["ids"].tolist() == [10 * i for i in range(n)]
    assert_unchanged(d, snap)
    padded2, pad2 = pad_dataproto_to_divisor(d, divisor)
    assert pad2 == pad and len(unpad_dataproto(padded2, pad2)) == n


def test_pad_errors():
    with pytest.raises(DataProtoError):
        make(3).pad_to_divisor(0)
    with pytest.raises(DataProtoError):
        make(3).unpad(4)


def test_pad_metrics_not_duplicated():
    padded, _ = make(3, meta={"metrics": {"a": 1}}).pad_to_divisor(4)
    assert padded.meta_info["metrics"] == {"a": 1}


# --- fold / unfold ---------------------------------------------------------------------------------


def test_fold_and_unfold():
    d = make(6)
    snap = snapshot(d)
    f = fold_batch_dim(d, 2)
    assert len(f) == 2 and f.batch["obs"].shape == (2, 3, 3) and f.non_tensor_batch["names"].shape == (2, 3)
    assert torch.equal(f.batch["obs"], d.batch["obs"].reshape(2, 3, 3))
    u = unfold_batch_dim(f, batch_dims=2)
    assert torch.equal(u.batch["obs"], d.batch["obs"])
    assert list(u.non_tensor_batch["names"]) == list(d.non_tensor_batch["names"])
    assert_unchanged(d, snap)
    with pytest.raises(DataProtoError):
        fold_batch_dim(d, 4)
    with pytest.raises(DataProtoError, match="'ids'"):
        unfold_batch_dim(d, batch_dims=2)


# --- disk ----------------------------------------------------------------------------------------


def test_save_and_load(tmp_path):
    d = make(5, meta={"m": [1, 2]})
    d.batch["bf"] = torch.randn(5, 2).to(torch.bfloat16)
    path = tmp_path / "data.bin"
    d.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    for k in d.batch.keys():
        assert torch.equal(back.batch[k], d.batch[k]) and back.batch[k].dtype == d.batch[k].dtype
    assert list(back.non_tensor_batch["names"]) == list(d.non_tensor_batch["names"]) and back.meta_info == d.meta_info
    back.batch["obs"].add_(1)
    assert not torch.equal(back.batch["obs"], d.batch["obs"])
    (tmp_path / "bad").write_bytes(b"not a file")
    with pytest.raises(DataProtoError, match="magic"):
        DataProto.load_from_disk(tmp_path / "bad")


def test_zero_length_batch_operations():
    d = make(0)
    assert [len(p) for p in d.chunk(3)] == [0, 0, 0]
    assert len(DataProto.concat(d.chunk(3))) == 0
    assert len(d.repeat(3)) == 0 and len(d.split(2)) == 0
    assert d.pad_to_divisor(4)[1] == 0
