"""The call-header cache: owned by an object (one per executor), bounded, keyed by everything that
changes the header's bytes.  Decoding the cached bytes gives the same call as a fresh encoding,
and decoding keeps every header field (each one, taken from ``dataclasses.fields``, set away from its default)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

pytest.importorskip("ray")

from rankmesh.backend import RankCall, Shared  # noqa: E402
from rankmesh.backends.ray.wire import CallHeader, HeaderCache, SharedSlot, decode_call, encode_call, encode_rank_call  # noqa: E402


def test_slot_only_headers_are_encoded_once_per_cache():
    cache = HeaderCache()
    call = RankCall(0, (Shared(object()),), {}, True)
    first, refs = encode_call(None, "compute", call, cache)
    again, _ = encode_call(None, "compute", RankCall(3, (Shared(object()),), {}, True), cache)
    assert again is first and cache.hits == 1 and len(cache) == 1  # same bytes object: not re-pickled
    assert len(refs) == 1
    other = HeaderCache()  # another executor's cache knows nothing of it
    fresh, _ = encode_call(None, "compute", call, other)
    assert fresh == first and fresh is not first and other.hits == 0
    assert pickle.loads(first) == CallHeader(None, "compute", (SharedSlot(0),), {}, True, False, None)


@pytest.mark.parametrize(
    "change",
    [
        {"return_output": False},
        {"trace": True},
        {"receive": "copy"},
    ],
)
def test_every_field_that_changes_the_bytes_is_in_the_key(change):
    cache = HeaderCache()
    base, _ = encode_call("actor", "compute", RankCall(0, (Shared(object()),)), cache)
    changed, _ = encode_call("actor", "compute", RankCall(0, (Shared(object()),), **change), cache)
    assert changed != base
    header = decode_call(changed, ("value",))
    assert header.args == ("value",)
    for key, value in change.items():
        assert getattr(header, key) == value


def test_calls_with_plain_arguments_are_not_cached():
    cache = HeaderCache()
    a, _ = encode_call(None, "f", RankCall(0, (1, 2)), cache)
    b, _ = encode_call(None, "f", RankCall(0, (1, 3)), cache)
    assert len(cache) == 0 and decode_call(a, ()).args == (1, 2) and decode_call(b, ()).args == (1, 3)


def test_cache_is_bounded():
    cache = HeaderCache(max_entries=2)
    for name in ("a", "b", "c"):
        encode_call(None, name, RankCall(0, ()), cache)
    assert len(cache) == 2
    out, _ = encode_call(None, "c", RankCall(0, ()), cache)  # past the bound: still correct
    assert decode_call(out, ()).method == "c"


def test_slot_only_headers_get_call_slots_until_they_run_out():
    cache = HeaderCache(slots=2)
    slots = [encode_rank_call(None, name, RankCall(0, (Shared(object()),)), cache)[2] for name in ("a", "b", "c")]
    assert slots == [0, 1, None]  # the third header is sent with every call
    assert encode_rank_call(None, "b", RankCall(5, (Shared(object()),)), cache)[2] == 1  # same key, same slot
    assert encode_rank_call(None, "f", RankCall(0, (1,)), cache)[2] is None  # a plain argument: no slot
    assert HeaderCache(slots=0).put(("k",), b"h") is None


def test_installs_are_kept_per_rank_and_process():
    cache = HeaderCache()
    _, _, slot = encode_rank_call(None, "f", RankCall(0, ()), cache)
    first, replacement = object(), object()  # two actor handles of rank 0: the old process and its replacement
    assert not cache.installed(slot, 0, first)
    cache.mark_installed(slot, 0, first)
    assert cache.installed(slot, 0, first) and not cache.installed(slot, 1, first)
    assert not cache.installed(slot, 0, replacement)  # a new process must be installed again


def _non_default(f: dataclasses.Field) -> Any:
    """A value for header field ``f`` that no default and no slot filling produces."""
    return {
        "role": "critic",
        "method": "compute_values",
        "args": (SharedSlot(0), 7),
        "kwargs": {"batch": SharedSlot(1), "scale": 2},
        "receive": "copy",
    }.get(f.name, not f.default if isinstance(f.default, bool) else f"non-default {f.name}")


def test_filling_slots_keeps_every_header_field():
    # Every field of CallHeader, each set away from its default (derived from the dataclass, so a
    # field added later is covered too); filling the slots may change args and kwargs only.
    fields = dataclasses.fields(CallHeader)
    header = CallHeader(**{f.name: _non_default(f) for f in fields})
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert getattr(header, f.name) != f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(header, f.name) != f.default_factory(), f.name
    filled = decode_call(pickle.dumps(header), ("first", "second"))
    assert filled.args == ("first", 7) and filled.kwargs == {"batch": "second", "scale": 2}
    for f in fields:
        if f.name not in ("args", "kwargs"):
            assert getattr(filled, f.name) == getattr(header, f.name), f"fill_call dropped {f.name}"


def test_the_fetch_mark_is_in_the_key_and_survives_decoding():
    cache = HeaderCache()
    call = RankCall(0, (Shared(object()),), {}, True, trace=True)
    plain, _, slot = encode_rank_call(None, "compute", call, cache)
    marked, _, marked_slot = encode_rank_call(None, "compute", call, cache, fetch_mark=True)
    assert marked != plain and marked_slot != slot and len(cache) == 2
    assert decode_call(marked, ("value",)).fetch_mark is True  # with a shared value: filled, mark kept
    assert decode_call(plain, ("value",)).fetch_mark is False


def test_what_travels_inside_a_header_is_small_and_holds_no_ray_handle():
    """``inline``: at most INLINE_BYTES pickled (the boundary measured by pickling with the
    header's own pickler here, an independent count), no ObjectRef or actor handle anywhere inside
    (one pickled outside Ray's serialization stays pinned), and anything that does not pickle
    takes the store (which says why).  A large tensor is refused from its size alone.  A header
    carrying an inline object decodes to a copy of the object, as sent."""
    import numpy as np
    import ray
    import torch
    from ray import cloudpickle

    from rankmesh.backends.ray.wire import INLINE_BYTES, inline
    from rankmesh.data import DataProto

    def pickled(obj: Any) -> int:
        return len(cloudpickle.dumps(obj, protocol=5))

    def travels(obj: Any) -> bool:
        return inline(obj) is not None

    fits = b"x" * (INLINE_BYTES - 64)
    while pickled(fits) < INLINE_BYTES:
        fits += b"x"
    assert pickled(fits) == INLINE_BYTES and travels(fits)
    assert not travels(fits + b"x")
    batch = DataProto.from_dict({"x": torch.arange(8)}, non_tensors={"s": np.array(list("abcdefgh"), dtype=object)})
    assert travels(batch)
    header = encode_rank_call(None, "compute", RankCall(0, (inline(batch), 3), {"b": inline([1, 2])}))[0]
    call = pickle.loads(header)
    assert torch.equal(call.args[0].batch["x"], torch.arange(8)) and list(call.args[0].non_tensor_batch["s"]) == list("abcdefgh")
    assert call.args[1] == 3 and call.kwargs == {"b": [1, 2]}
    assert not travels(DataProto.from_dict({"x": torch.zeros(INLINE_BYTES + 1, dtype=torch.uint8)}))
    assert not travels(np.zeros(INLINE_BYTES + 1, dtype=np.uint8))
    ref = ray.ObjectRef.nil()
    assert not travels(DataProto.from_dict({"x": torch.arange(2)}, meta_info={"deep": [{"ref": ref}]}))
    assert not travels([1, 2, ref])
    assert travels(lambda: 3)  # cloudpickle's by-value function, as in a header
    assert not travels(__import__("threading").Lock())  # does not pickle
