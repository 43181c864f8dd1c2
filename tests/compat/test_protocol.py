"""verl 0.9.1's DataProto behaviour under rankmesh.compat.verl, written as a verl user's tests.

Expected values are worked out by hand from the inputs (and from verl 0.9.1's documented
semantics), never computed by rankmesh.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rankmesh.compat.verl import (
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    collate_fn,
    union_numpy_dict,
    union_tensor_dict,
)


def make(n: int = 4, **meta) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info=dict(meta),
    )


# --- error types: verl asserts, so verl code catches AssertionError -----------------------------


def test_union_with_a_differing_shared_key_is_an_assertion_naming_the_key():
    a, b = make(), make()
    b.batch["x"] = b.batch["x"] + 1
    with pytest.raises(AssertionError, match="'x'"):
        a.union(b)
    assert a.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0], "a failed union changes nothing"


def test_chunk_into_a_count_that_does_not_divide_is_an_assertion():
    with pytest.raises(AssertionError, match="5 rows into 2"):
        make(5).chunk(2)


def test_chunk_with_auto_padding_allows_uneven_pieces():
    data = DataProto.from_dict(tensors={"x": torch.arange(5)}, auto_padding=True)
    assert [p.batch["x"].tolist() for p in data.chunk(2)] == [[0, 1, 2], [3, 4]]
    previous = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = True
    try:
        assert [len(p) for p in make(5).chunk(2)] == [3, 2]
    finally:
        DataProtoConfig.auto_padding = previous


def test_concat_with_conflicting_meta_info_names_the_key():
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([make(2, config="a"), make(2, config="b")])


def test_concat_gathers_metrics_and_keeps_equal_meta_info():
    out = DataProto.concat([make(2, temperature=1.0, metrics={"loss": 1}), make(2, temperature=1.0, metrics={"loss": 2})])
    assert out.meta_info == {"temperature": 1.0, "metrics": {"loss": [1, 2]}}
    assert out.batch["x"].tolist() == [0.0, 1.0, 0.0, 1.0] and isinstance(out, DataProto)


def test_from_dict_num_batch_dims_mismatch_is_an_assertion():
    with pytest.raises(AssertionError, match="batch_dims=2"):
        DataProto.from_dict(tensors={"a": torch.zeros(2, 3, 4), "b": torch.zeros(2, 5)}, num_batch_dims=2)
    with pytest.raises(AssertionError, match="greater than zero"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, num_batch_dims=0)
    with pytest.raises(AssertionError, match="num_batch_dims=1"):
        DataProto.from_dict(tensors={"a": torch.zeros(2, 3)}, non_tensors={"u": [1, 2]}, num_batch_dims=2)


def test_from_dict_refuses_more_than_one_batch_dim_as_verl_does():
    # verl 0.9.1's test_tensor_dict_constructor: leading dims agree, and still an AssertionError
    # (its check_consistency: "only support num_batch_dims=1").
    obs, act = torch.randn(100, 10), torch.randn(100, 10, 3)
    assert DataProto.from_dict(tensors={"obs": obs, "act": act}).batch.batch_size == torch.Size([100])
    with pytest.raises(AssertionError, match="only support num_batch_dims=1"):
        DataProto.from_dict(tensors={"obs": obs, "act": act}, num_batch_dims=2)
    with pytest.raises(AssertionError):
        DataProto.from_dict(tensors={"obs": obs, "act": act}, num_batch_dims=3)
    # without tensors there is no batch to have dims: verl builds it
    assert len(DataProto.from_dict(non_tensors=None, tensors={}, num_batch_dims=2)) == 0


# --- in-place unions ---------------------------------------------------------------------------


def test_union_updates_self_in_place_and_returns_it():
    a = DataProto.from_dict(tensors={"x": torch.arange(3)}, meta_info={"m": 1})
    b = DataProto.from_dict(tensors={"y": torch.arange(3) * 2}, non_tensors={"tag": ["p", "q", "r"]}, meta_info={"n": 2})
    c = DataProto.from_dict(tensors={"z": torch.arange(3) * 3})
    batch_before = a.batch
    a.union(b)  # verl code drops the result
    assert a.union(c) is a
    assert sorted(a.batch.keys()) == ["x", "y", "z"] and a.batch is batch_before
    assert a.batch["y"].tolist() == [0, 2, 4] and a.non_tensor_batch["tag"].tolist() == ["p", "q", "r"]
    assert a.meta_info == {"m": 1, "n": 2}


def test_union_tensor_dict_updates_its_first_argument():
    td1 = TensorDict({"a": torch.arange(3)}, batch_size=[3])
    td2 = TensorDict({"b": torch.arange(3) + 10}, batch_size=[3])
    assert union_tensor_dict(td1, td2) is td1
    assert td1["b"].tolist() == [10, 11, 12]
    with pytest.raises(AssertionError):
        union_tensor_dict(td1, TensorDict({"a": torch.zeros(3, dtype=torch.int64)}, batch_size=[3]))


def test_union_numpy_dict_updates_its_first_argument_and_compares_nan_and_objects():
    d1 = {"a": np.array([1.0, np.nan]), "obj": np.array([np.nan, "nan", 3], dtype=object)}
    d2 = {"a": np.array([1.0, np.nan]), "obj": np.array([np.nan, "nan", 3], dtype=object), "new": np.array([5, 6])}
    assert union_numpy_dict(d1, d2) is d1 and d1["new"].tolist() == [5, 6]
    # element-wise over n-dimensional arrays
    grid = {"g": np.arange(6).reshape(2, 3)}
    union_numpy_dict(grid, {"g": np.arange(6).reshape(2, 3)})
    with pytest.raises(AssertionError, match="`g` in tensor_dict1 and tensor_dict2 are not the same object."):
        union_numpy_dict(grid, {"g": np.array([[0, 1, 2], [3, 4, 9]])})
    # a float NaN is not the string "nan"
    with pytest.raises(AssertionError, match="`obj` in tensor_dict1"):
        union_numpy_dict({"obj": np.array([np.nan], dtype=object)}, {"obj": np.array(["nan"], dtype=object)})


def test_union_numpy_dict_compares_cycles_without_recursing_forever():
    # verl 0.9.1's test_union_numpy_dict, case 5: two cycles of one shape are equal, a cycle is
    # not a non-cycle; and its exact message for a differing key.
    circ_1, circ_2, flat = (np.array([None], dtype=object) for _ in range(3))
    circ_1[0], circ_2[0] = circ_1, circ_2
    union_numpy_dict({"data": circ_1}, {"data": circ_2})
    with pytest.raises(AssertionError):
        union_numpy_dict({"data": circ_1}, {"data": flat})
    arr = np.arange(24, dtype=np.int32).reshape((2, 3, 4))
    with pytest.raises(AssertionError, match="`nd_array` in tensor_dict1 and tensor_dict2 are not the same object."):
        union_numpy_dict({"nd_array": arr}, {"nd_array": arr + 1})


# --- padding, unfolding, repeating ---------------------------------------------------------------


def test_padding_pads_in_place_with_the_last_or_first_row():
    data = make(3)
    assert data.padding(2) is None
    assert data.batch["x"].tolist() == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u2", "u2"]
    first = make(3)
    first.padding(1, padding_candidate="first")
    assert first.batch["x"].tolist() == [0.0, 1.0, 2.0, 0.0]


def test_unfold_column_chunks_splits_dim_one_and_repeats_the_rest():
    data = DataProto.from_dict(
        tensors={"resp": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "score": torch.tensor([10, 20])},
        non_tensors={"uid": ["a", "b"]},
    )
    out = data.unfold_column_chunks(2, split_keys=["resp"])
    assert out.batch["resp"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["score"].tolist() == [10, 10, 20, 20]
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]


def test_unfold_column_chunks_splits_each_rows_list_in_a_non_tensor_column():
    # verl 0.9.1's test_dataproto_unfold_column_chunks, second case: rows of equal-length lists.
    data = DataProto.from_dict(
        tensors={"obs1": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])},
        non_tensors={"labels": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]},
        meta_info={"name": "abc"},
    )
    ret = data.unfold_column_chunks(2, split_keys=["obs1", "labels"])
    assert ret.batch["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert (ret.non_tensor_batch["labels"] == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]).all()
    assert ret.meta_info == {"name": "abc"}
    with pytest.raises(AssertionError, match="'labels'"):  # lists of odd lengths do not split in two
        DataProto.from_dict(non_tensors={"labels": [["a"], ["b"]]}).unfold_column_chunks(2, split_keys=["labels"])


def test_sample_level_repeat_and_from_tensordict_as_verl_spells_them():
    data = make(3)
    assert data.sample_level_repeat([2, 0, 1]).batch["x"].tolist() == [0.0, 0.0, 2.0]
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    back = DataProto.from_tensordict(td, {"step": 7})  # verl: (tensor_dict, meta_info, num_batch_dims)
    assert back.meta_info == {"step": 7} and back.batch["x"].tolist() == [0, 1]


def test_to_moves_self_and_returns_it():
    data = make(2)
    assert data.batch.device is None
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")


def test_collate_fn_stacks_items_into_a_batch():
    data = make(3)
    out = collate_fn([data[2], data[0]])
    assert isinstance(data[0], DataProtoItem)
    assert out.batch["x"].tolist() == [2.0, 0.0] and out.non_tensor_batch["uid"].tolist() == ["u2", "u0"]


def test_derived_batches_stay_compat_batches():
    data = make(4)
    for derived in (data[1:3], data.chunk(2)[0], data.select(["x"]), DataProto.concat([data, data]), data.repeat(2)):
        assert type(derived) is DataProto
    with pytest.raises(AssertionError):  # so verl's semantics hold on them too
        data[0:3].chunk(2)
