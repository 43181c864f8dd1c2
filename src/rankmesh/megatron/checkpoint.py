"""Checkpoints of a worker's modules and optimizers in global coordinates, through megatron-core's dist_checkpointing.

Why global coordinates: every rank names each tensor it holds by its name in the whole model
and says which box of the whole tensor it holds, so a checkpoint written on one mesh is read on
any other.  dist_checkpointing (torch.distributed.checkpoint underneath) intersects the boxes a
loading rank asks for with the boxes that were saved and reads only the overlap: the reshard
happens on load, with no gather anywhere.

What one rank contributes (:func:`sharded_state_dict`):

1. each parameter of the checkpointed modules, as ``model.<module>.<global name>``.  The global
   name and the tp cut come from :func:`rankmesh.megatron.layouts.layouts_from_module`, the rule
   the reshard planner uses (pipeline layer offsets undone; megatron's ``tensor_model_parallel``
   / ``partition_dim`` attributes); the offset along ``partition_dim`` is the rank's tp rank;
2. each optimizer state entry, as ``optimizer.<optimizer>.<entry>.<module>.<global name>``: a
   tensor of the parameter's shape (Adam's ``exp_avg`` and ``exp_avg_sq``) is cut like the
   parameter; anything else (Adam's scalar ``step``) is a ShardedObject, equal on every holder;
3. the common part, written by rank 0 (dist_checkpointing warns if ranks differ): the format,
   the weight version, the mesh that saved it and each optimizer's param-group hyperparameters.

Of the ranks that hold the same piece (dp and cp replicas; every tp rank, for a tensor that tp
replicates) only replica 0 writes it: ``replica_id`` is (0, tp rank if tp replicates it else 0,
dp-cp rank), megatron's own convention.

Writing: megatron's default ``torch_dist`` save strategy writes through ``FileSystemWriterAsync``,
which, even for a synchronous save, starts a ``multiprocessing.Manager`` in a *spawned* process
(it re-runs the main module: it fails in a script without a main guard, and costs a fresh
interpreter per rank otherwise), forks one writer process per file and calls
``torch.cuda.synchronize``.  :class:`SyncTorchDistSave` writes the same ``torch_dist`` format with
torch.distributed.checkpoint's plain ``FileSystemWriter`` in the rank's own process, one file per
rank.  Loading uses megatron's default ``torch_dist`` load strategy unchanged.

Before writing or reading, every rank checks what it can (the directory; its tensors against the
checkpoint's metadata) and all ranks agree (:func:`agree`): a problem anywhere raises
:class:`~rankmesh.errors.CheckpointError` on every rank, rather than on the ranks that found it
while the others wait for them in the load's collectives.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict
from torch.distributed import checkpoint as dcp

from rankmesh.errors import CheckpointError
from rankmesh.megatron.layouts import layouts_from_module
from rankmesh.mesh import RankMesh
from rankmesh.reshard.plan import ParamLayout

logger = logging.getLogger(__name__)

#: Version of the layout of keys and of the common record below; a load refuses any other.
FORMAT = 1
#: Key of rankmesh's record in the checkpoint's common (non-sharded) part.
COMMON_KEY = "rankmesh"
#: The file dist_checkpointing writes last: a directory without it is not a finished checkpoint.
METADATA_FILE = "metadata.json"
#: At most this many problems are listed in one error (a wrong model gives one per tensor).
MAX_LISTED = 5


# ----- names: the one place that spells a checkpoint key --------------------------------------


def model_key(param: str) -> str:
    """Key of parameter ``param`` (``<module>.<global name>``)."""
    return f"model.{param}"


def optimizer_key(optimizer: str, param: str, entry: str) -> str:
    """Key of state ``entry`` (``exp_avg``, ``step``) that optimizer ``optimizer`` keeps for ``param``.

    The entry comes before the parameter, as in megatron's own ``optimizer.state.exp_avg.<param>``:
    optimizer attribute names and state entry names hold no dot, parameter names do.  No ``/``
    anywhere: dist_checkpointing splits a ShardedObject's stored key at its one ``/``.
    """
    return f"optimizer.{optimizer}.{entry}.{param}"


def split_optimizer_key(key: str) -> tuple[str, str, str] | None:
    """(optimizer, param, entry) of an :func:`optimizer_key`; ``None`` for any other key."""
    parts = key.split(".", 3)
    if len(parts) != 4 or parts[0] != "optimizer":
        return None
    _, optimizer, entry, param = parts
    return optimizer, param, entry


# ----- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlace:
    """Where this rank's pieces sit, as parallel_state reports it: tp rank of ``tp_size``, dp-cp rank.

    The pipeline stage needs no coordinate: a stage's parameters have global names of their own.
    """

    tp_rank: int
    tp_size: int
    dp_rank: int  # over dp x cp: the ranks that hold the same shard


@dataclass(frozen=True)
class Param:
    """One parameter of this rank: ``<module>.<global name>``, the tensor, its layout in the whole model."""

    name: str
    tensor: torch.Tensor
    layout: ParamLayout


@dataclass(frozen=True)
class CheckpointReport:
    """What one rank did: where, how long, what it wrote (its own replicas only) or read, and the weight version."""

    path: str
    rank: int
    seconds: float
    tensors: int
    bytes: int
    weight_version: int
    optimizers: bool  # optimizer state saved, or loaded (False: reset)


# ----- this rank's part, in global coordinates --------------------------------------------------


def checkpoint_params(modules: Mapping[str, torch.nn.Module], mesh: RankMesh, rank: int) -> list[Param]:
    """Every parameter of ``modules`` (attribute name -> module) with its global name and tp layout."""
    out = []
    for module_name, module in modules.items():
        tensors = [p for _, p in module.named_parameters()]
        layouts = layouts_from_module(module, mesh, rank)  # walks named_parameters() too: same order
        for tensor, layout in zip(tensors, layouts, strict=True):
            name = f"{module_name}.{layout.name}"
            if layout.tp_stride != 1:
                raise CheckpointError(
                    f"parameter {name!r} is cut with partition_stride={layout.tp_stride} (interleaved tp blocks): "
                    "rankmesh checkpoints support stride 1 only; save this module with megatron's own "
                    "sharded_state_dict() and dist_checkpointing.save"
                )
            out.append(Param(name, tensor, layout))
    return out


def _cut_like(key: str, tensor: torch.Tensor, param: Param, place: ShardPlace) -> ShardedTensor:
    """``tensor`` (this rank's piece, shaped like ``param``'s) as a ShardedTensor cut like ``param``."""
    tp_dim = param.layout.tp_dim
    if tp_dim is None or place.tp_size == 1:
        return ShardedTensor.from_rank_offsets(key, tensor, replica_id=(0, place.tp_rank, place.dp_rank))
    return ShardedTensor.from_rank_offsets(
        key, tensor, (tp_dim, place.tp_rank, place.tp_size), replica_id=(0, 0, place.dp_rank)
    )


def _object(key: str, value: Any, place: ShardPlace) -> ShardedObject:
    """``value`` as one object every holder of the parameter has (replica 0 writes it)."""
    return ShardedObject(key, value, (1,), (0,), replica_id=(0, place.tp_rank, place.dp_rank))


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _owners(params: Sequence[Param], optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, list[Param]]:
    """Optimizer name -> the Param of each tensor it updates, in the optimizer's order."""
    by_id = {id(p.tensor): p for p in params}
    out = {}
    for name, optimizer in optimizers.items():
        owned = []
        for tensor in _optimizer_params(optimizer):
            if id(tensor) not in by_id:
                raise CheckpointError(
                    f"optimizer {name!r} updates a parameter of shape {tuple(tensor.shape)} that no checkpointed module "
                    "holds: return its module from checkpoint_modules() as well"
                )
            owned.append(by_id[id(tensor)])
        out[name] = owned
    return out


def common_record(optimizers: Mapping[str, torch.optim.Optimizer], weight_version: int, mesh: RankMesh) -> dict[str, Any]:
    """The common part: equal on every rank (rank 0 writes it)."""
    return {
        "format": FORMAT,
        "weight_version": int(weight_version),
        "saved_on": str(mesh),
        "optimizers": {
            name: [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            for name, optimizer in optimizers.items()
        },
    }


def sharded_state_dict(
    params: Sequence[Param], optimizers: Mapping[str, torch.optim.Optimizer], place: ShardPlace, common: dict[str, Any]
) -> dict[str, Any]:
    """This rank's parameters and optimizer state as dist_checkpointing's ShardedStateDict (module docstring)."""
    out: dict[str, Any] = {}
    for param in params:
        key = model_key(param.name)
        out[key] = _cut_like(key, param.tensor.detach(), param, place)
    for name, owned in _owners(params, optimizers).items():
        state = optimizers[name].state
        for param in owned:
            for entry, value in state.get(param.tensor, {}).items():
                key = optimizer_key(name, param.name, entry)
                if torch.is_tensor(value) and value.shape == param.tensor.shape:
                    out[key] = _cut_like(key, value.detach(), param, place)
                else:
                    out[key] = _object(key, value, place)
    out[COMMON_KEY] = common
    return out


# ----- agreeing before a collective -------------------------------------------------------------


def agree(problem: str | None, mesh: RankMesh) -> None:
    """Raise :class:`CheckpointError` on every rank if any rank of ``mesh`` found a problem (collective).

    A rank that raised alone would leave the others blocked in the next collective of the save
    or load; here all ranks raise, each with the text :func:`agreed` gives it.
    """
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    text = agreed(problems, dist.get_rank(), mesh)
    if text is not None:
        raise CheckpointError(text)


def agreed(problems: Sequence[str | None], rank: int, mesh: RankMesh) -> str | None:
    """What ``rank`` raises once every rank's problem is known: its own, else the first found, naming its rank.

    A rank's own problem does not name the rank: the controller's :class:`~rankmesh.errors.WorkerError`
    names it and every other failing rank, once.  ``None`` when no rank found a problem.
    """
    if problems[rank]:
        return problems[rank]
    found = next(((r, text) for r, text in enumerate(problems) if text), None)
    return None if found is None else f"{mesh.rank_coords(found[0]).rank_text(found[0])} found: {found[1]}"


def _listed(head: str, problems: list[str], fix: str) -> str | None:
    """``head``, the first :data:`MAX_LISTED` problems, how many more, and the ``fix`` (``None`` if no problem)."""
    if not problems:
        return None
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{head}: " + "; ".join(problems[:MAX_LISTED]) + more + f" ({fix})"


# ----- saving -------------------------------------------------------------------------------------


class SyncTorchDistSave(SaveShardedStrategy):
    """megatron's ``torch_dist`` format, written in this process by torch's ``FileSystemWriter`` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)  # the format a default load strategy reads

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: Any) -> None:
        # Grouped by key, main replicas only: what megatron's own torch_dist strategy hands
        # torch.distributed.checkpoint (_replace_state_dict_keys_with_sharded_keys, keep_only_main_replica).
        grouped: dict[str, list[Any]] = defaultdict(list)
        for item in nested_values(sharded_state_dict):
            if is_main_replica(item.replica_id):
                grouped[item.unique_key if isinstance(item, ShardedObject) else item.key].append(item)
        dcp.save(
            mcore_to_pyt_state_dict(dict(grouped), False),
            storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


def _save_problem(path: str) -> str | None:
    if os.path.isfile(path):
        return f"checkpoint path {path!r} is a file: give a directory (it is created if missing)"
    if os.path.isdir(path) and os.listdir(path):
        return (f"checkpoint directory {path!r} is not empty: save each checkpoint into a new directory "
                "(dist_checkpointing would mix the old files with the new ones)")
    return None


def _written(state: Mapping[str, Any]) -> tuple[int, int]:
    """(tensors, bytes) of the ShardedTensors this rank writes (its main replicas)."""
    tensors = [v for v in state.values() if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id)]
    return len(tensors), sum(t.data.numel() * t.data.element_size() for t in tensors)


def save(
    path: str,
    modules: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    mesh: RankMesh,
    rank: int,
    place: ShardPlace,
    weight_version: int,
) -> CheckpointReport:
    """Write this rank's part of a checkpoint into the new directory ``path`` (collective: every rank calls it).

    ``modules``/``optimizers``: attribute name -> object (the names become part of the keys);
    ``mesh``/``rank``: the mesh the modules are laid out by and this rank's place in it.
    """
    start = time.perf_counter()
    path = os.path.abspath(path)
    problem, state = _save_problem(path), {}
    try:
        params = checkpoint_params(modules, mesh, rank)
        state = sharded_state_dict(params, optimizers, place, common_record(optimizers, weight_version, mesh))
    except CheckpointError as exc:
        problem = problem or str(exc)
    agree(problem, mesh)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path, sharded_strategy=SyncTorchDistSave())
    tensors, nbytes = _written(state)
    seconds = time.perf_counter() - start
    logger.info("rank %d: saved %d tensors (%d bytes) to %s in %.3f s", rank, tensors, nbytes, path, seconds)
    return CheckpointReport(path, rank, seconds, tensors, nbytes, int(weight_version), bool(optimizers))


# ----- loading ------------------------------------------------------------------------------------


def _load_problem(path: str) -> str | None:
    if not os.path.exists(path):
        return f"no checkpoint at {path!r}: the path does not exist (check it, and that every rank's node sees it)"
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        return (f"{path!r} is not a finished checkpoint: {os.path.join(path, METADATA_FILE)} is missing "
                "(dist_checkpointing writes it last: the save did not complete, or this is another kind of directory)")
    return None


def shape_problems(wanted: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...]]) -> list[str]:
    """One line per tensor this rank needs that a checkpoint lacks or holds in another shape.

    ``wanted`` and ``saved`` map keys to whole (global) shapes: this model's and the checkpoint's.
    """
    out = []
    for key, shape in wanted.items():
        if key not in saved:
            out.append(f"tensor {key!r} {tuple(shape)} is missing there")
        elif tuple(saved[key]) != tuple(shape):
            out.append(f"tensor {key!r} is {tuple(saved[key])} there, {tuple(shape)} here")
    return out


def _optimizer_problems(common: Mapping[str, Any], optimizers: Mapping[str, torch.optim.Optimizer]) -> list[str]:
    saved = common["optimizers"]
    if sorted(saved) != sorted(optimizers):
        return [f"it holds state of optimizers {sorted(saved)}, this worker has {sorted(optimizers)}"]
    return [
        f"optimizer {name!r} had {len(saved[name])} param groups, this one has {len(opt.param_groups)}"
        for name, opt in optimizers.items() if len(saved[name]) != len(opt.param_groups)
    ]


def _template(
    params: Sequence[Param],
    owners: Mapping[str, list[Param]],
    saved: Mapping[str, Any],
    place: ShardPlace,
    with_optimizers: bool,
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """What this rank reads, over fresh buffers: (the sharded state dict, key -> the whole shape it needs).

    ``saved`` is the checkpoint's metadata (key -> ShardedTensor or ShardedObject, without data):
    the optimizer entries to read are the ones it holds for each parameter.
    """
    template: dict[str, Any] = {}
    wanted: dict[str, tuple[int, ...]] = {}
    for param in params:
        key = model_key(param.name)
        wanted[key] = param.layout.shape
        template[key] = _cut_like(key, torch.empty_like(param.tensor), param, place)
    if not with_optimizers:
        return template, wanted
    entries: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    for key, meta in saved.items():
        parts = split_optimizer_key(key)
        if parts is not None:
            entries[parts[:2]][parts[2]] = meta
    for name, owned in owners.items():
        for param in owned:
            for entry, meta in entries.get((name, param.name), {}).items():
                key = optimizer_key(name, param.name, entry)
                if isinstance(meta, ShardedObject):
                    template[key] = _object(key, None, place)
                else:  # saved as a tensor only when shaped like the parameter
                    wanted[key] = param.layout.shape
                    template[key] = _cut_like(key, torch.empty_like(param.tensor, dtype=meta.dtype), param, place)
    return template, wanted


def _apply(
    loaded: Mapping[str, Any],
    params: Sequence[Param],
    optimizers: Mapping[str, torch.optim.Optimizer],
    owners: Mapping[str, list[Param]],
    groups: Mapping[str, list[dict[str, Any]]],
    with_optimizers: bool,
) -> None:
    """Copy what was read into the parameters; rebuild each optimizer's state (or reset it)."""
    with torch.no_grad():
        for param in params:
            param.tensor.copy_(loaded[model_key(param.name)])
    entries: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)  # (optimizer, param) -> entry -> value
    for key, value in loaded.items():
        parts = split_optimizer_key(key)
        if parts is not None:
            entries[parts[:2]][parts[2]] = value
    for name, optimizer in optimizers.items():
        if not with_optimizers:
            optimizer.state.clear()
            continue
        state = {index: entries[name, param.name] for index, param in enumerate(owners[name])
                 if (name, param.name) in entries}
        current = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({
            "state": state,
            "param_groups": [{**saved, "params": group["params"]} for saved, group in zip(groups[name], current)],
        })


def load(
    path: str,
    modules: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    mesh: RankMesh,
    rank: int,
    place: ShardPlace,
    with_optimizers: bool = True,
) -> CheckpointReport:
    """Read this rank's part of the checkpoint at ``path`` into ``modules`` and ``optimizers`` (collective).

    Nothing changes until every rank has checked its tensors against the checkpoint's metadata
    and the read has succeeded (pieces are read into fresh buffers, then copied: one extra copy
    of this rank's shard at a time).  With ``with_optimizers=False`` only the weights are read
    and every optimizer's state is reset (a fresh start from saved weights).
    """
    start = time.perf_counter()
    path = os.path.abspath(path)
    problem, params, owners = _load_problem(path), [], {}
    try:
        params = checkpoint_params(modules, mesh, rank)
        owners = _owners(params, optimizers)
    except CheckpointError as exc:
        problem = problem or str(exc)
    agree(problem, mesh)
    common = dist_checkpointing.load_common_state_dict(path).get(COMMON_KEY, {})
    if common.get("format") != FORMAT:  # the same file on every rank: every rank takes this branch
        agree(f"{path!r} holds no rankmesh checkpoint record of format {FORMAT} (found {common.get('format')!r}); "
              "write checkpoints with save_checkpoint()", mesh)
    saved = {v.key: v for v in load_sharded_metadata(path).values()}
    template, wanted = _template(params, owners, saved, place, with_optimizers)
    saved_shapes = {k: tuple(v.global_shape) for k, v in saved.items() if isinstance(v, ShardedTensor)}
    head = f"checkpoint {path!r} (saved on {common.get('saved_on')}) does not fit this worker"
    agree(_listed(head, _optimizer_problems(common, optimizers) if with_optimizers else [],
                  "load with optimizers=False to start fresh optimizers from the saved weights")
          or _listed(head, shape_problems(wanted, saved_shapes), "load it into a model built with the sizes it was saved with"),
          mesh)

    with warnings.catch_warnings():
        # megatron-core 0.16 reads through torch's deprecated checkpoint.load_state_dict: its
        # FutureWarning names nothing a caller can change.
        warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
        loaded = dist_checkpointing.load(template, path)
    _apply(loaded, params, optimizers, owners, common["optimizers"], with_optimizers)

    read = [v for v in template.values() if isinstance(v, ShardedTensor)]
    seconds = time.perf_counter() - start
    nbytes = sum(t.data.numel() * t.data.element_size() for t in read)
    logger.info("rank %d: loaded %d tensors (%d bytes) from %s in %.3f s", rank, len(read), nbytes, path, seconds)
    return CheckpointReport(path, rank, seconds, len(read), nbytes, int(common["weight_version"]), with_optimizers)
