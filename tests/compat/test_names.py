"""Every public name of verl 0.9.1 a ported program can touch exists under rankmesh.compat.verl.

The expected lists (verl's ``protocol`` and ``utils.ray_utils`` modules, and its classes) were
extracted once from the verl 0.9.1 wheel by ``scripts/extract_verl_names.py`` into
``verl_0_9_1_names.json`` (an independent source: verl's own code, read with ``ast``).
``NOT_PROVIDED`` is the documented allow-list: names deliberately left out, each with the reason
(also in docs/porting.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rankmesh.compat.verl as verl
from rankmesh.compat.verl import DataProto, DataProtoFuture, RayResourcePool, RayWorkerGroup, Worker, WorkerGroup

NAMES = json.loads((Path(__file__).with_name("verl_0_9_1_names.json")).read_text())

NOT_PROVIDED: dict[str, str] = {
    "protocol.BatchData": "verl's internal wrapper for chunking dispatch arguments; rankmesh's dispatch splits DataProtos and TensorDicts itself",
    "protocol.serialize_single_tensor": "verl's pickling internals; rankmesh.serialization sends tensors out of band",
    "protocol.serialize_tensordict": "verl's pickling internals; rankmesh.serialization sends tensors out of band",
    "protocol.deserialize_single_tensor": "verl's pickling internals; rankmesh.serialization sends tensors out of band",
    "protocol.deserialize_tensordict": "verl's pickling internals; rankmesh.serialization sends tensors out of band",
    "protocol.all_gather_data_proto": "not provided yet: it needs a torch.distributed group inside the data layer, which knows no process groups",
    "DataProtoFuture.collect_fn": "verl's future stores its collect function; rankmesh's future stores parts and a fetcher, collection happens in the group",
    "DataProtoFuture.dispatch_fn": "verl's future stores a dispatch function; rankmesh plans dispatch in the group, not in the future",
    "DataProtoFuture.futures": "the handles are DataProtoFuture.handles",
    "RayResourcePool.add_node": "rankmesh pools reserve placement groups from the node list given at construction; pass every node count there",
    "RayWorkerGroup.start_worker_aliveness_check": "rankmesh checks liveness on every call (WorkerDiedError naming the rank) instead of SIGABRT-ing the driver",
    "WorkerGroup.start_worker_aliveness_check": "as RayWorkerGroup.start_worker_aliveness_check",
    "WorkerGroup.fused_worker_execute_fn_name": "verl's name of its internal fused-call method; rankmesh routes role calls itself (RayWorkerGroup keeps the constant)",
    "ray_utils.ray_noset_visible_devices": "rankmesh.devices applies the RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES rules in every worker process itself",
    "ray_utils.get_event_loop": "an asyncio helper of verl's trainers, not of its controller; use asyncio itself",
    "ray_utils.auto_await": "an asyncio helper of verl's trainers, not of its controller; async worker methods are awaited by the worker host",
}

#: verl module (as the names list keys it) -> the allow-list prefix of its names.  Each is
#: ported to the one module rankmesh.compat.verl, as verl.protocol is.
MODULES = {"utils.ray_utils": "ray_utils"}

CLASSES = {
    "DataProto": DataProto,
    "DataProtoFuture": DataProtoFuture,
    "RayResourcePool": RayResourcePool,
    "RayWorkerGroup": RayWorkerGroup,
    "Worker": Worker,
    "WorkerGroup": WorkerGroup,
}


def _has(owner: object, name: str) -> bool:
    if hasattr(owner, name):
        return True
    fields = getattr(owner, "__dataclass_fields__", {})  # DataProto's batch / meta_info ...
    return name in fields


def test_the_extracted_lists_are_verls():
    # a few names every verl user knows: guards against an empty or truncated extraction
    assert {"DataProto", "union_tensor_dict", "pad_dataproto_to_divisor"} <= set(NAMES["protocol"])
    assert {"parallel_put"} <= set(NAMES["modules"]["utils.ray_utils"])
    assert {"padding", "unfold_column_chunks", "sample_level_repeat"} <= set(NAMES["classes"]["DataProto"])
    assert {"execute_with_func_generator", "get_master_addr_port", "env_keys"} <= set(NAMES["classes"]["Worker"])
    assert {"spawn_fused", "fuse", "master_port", "worker_names"} <= set(NAMES["classes"]["RayWorkerGroup"])


def test_every_protocol_name_exists_or_is_documented():
    missing = [n for n in NAMES["protocol"] if not hasattr(verl, n) and f"protocol.{n}" not in NOT_PROVIDED]
    assert missing == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_utils_name_exists_or_is_documented(module):
    prefix = MODULES[module]
    missing = [n for n in NAMES["modules"][module] if not hasattr(verl, n) and f"{prefix}.{n}" not in NOT_PROVIDED]
    assert missing == []


@pytest.mark.parametrize("cls_name", sorted(CLASSES))
def test_every_class_member_exists_or_is_documented(cls_name):
    owner = CLASSES[cls_name]
    missing = [n for n in NAMES["classes"][cls_name] if not _has(owner, n) and f"{cls_name}.{n}" not in NOT_PROVIDED]
    assert missing == []


def test_the_allow_list_only_names_real_gaps():
    """An allowed name that compat now provides must leave the list (it would hide a difference)."""
    for key in NOT_PROVIDED:
        where, name = key.split(".")
        modules = {prefix: NAMES["modules"][module] for module, prefix in MODULES.items()}
        owner = verl if where == "protocol" or where in modules else CLASSES[where]
        listed = NAMES["protocol"] if where == "protocol" else modules[where] if where in modules else NAMES["classes"][where]
        assert name in listed, key
        assert not _has(owner, name), f"{key} is provided now: drop it from NOT_PROVIDED"


def test_the_porting_doc_lists_every_allowed_gap():
    doc = (Path(__file__).parents[2] / "docs" / "porting.md").read_text()
    for key in NOT_PROVIDED:
        assert key.split(".")[1] in doc, key
