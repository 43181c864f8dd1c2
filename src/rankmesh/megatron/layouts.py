"""megatron-core's parameter conventions for reshard: global layer names and tp layouts from the parameters' own attributes.

Why here and not in the reshard package: these are megatron-core's rules (a pipeline stage numbers
its layers from 0 and keeps the global number in ``layer_number``; the parallel layers mark a
parameter's tp split with ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``),
and :class:`~rankmesh.reshard.worker.ReshardWorker` knows no model.  Nothing here imports
megatron-core (or Ray): the rules read plain attributes, so a rollout process holding an
unsharded torch copy of the model uses them too.
"""

from __future__ import annotations

import re

import torch

from rankmesh.errors import ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.reshard.plan import ParamLayout
from rankmesh.reshard.worker import ReshardWorker

_LAYER = re.compile(r"^(.*\blayers)\.(\d+)$")


def global_parameter_names(module: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name in the whole model, undoing the pipeline's layer offsets.

    megatron-core numbers the layers of a stage from 0 (``decoder.layers.0``) and keeps the
    global number in ``TransformerLayer.layer_number`` (1-based); a module without that
    attribute keeps its name.
    """
    renames = {}
    for qual, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        match = _LAYER.match(qual)
        if match and isinstance(number, int):
            renames[qual + "."] = f"{match.group(1)}.{number - 1}."
    out = {}
    for name, _ in module.named_parameters():
        new = name
        for prefix, repl in renames.items():
            if name.startswith(prefix):
                new = repl + name[len(prefix):]
                break
        out[name] = new
    return out


def layouts_from_module(module: torch.nn.Module, mesh: RankMesh, rank: int) -> list[ParamLayout]:
    """This rank's parameters as ParamLayouts, from megatron-core's own parameter attributes.

    ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` (set by megatron's
    parallel layers) give the tp split; the full size along ``partition_dim`` is the local one
    times tp; ``pp_stage`` is this rank's stage (:func:`~rankmesh.reshard.merge_layouts` turns a
    parameter every stage reports into ``None``).  A parameter without the attributes is replicated.
    """
    coords = mesh.coords(rank)
    names = global_parameter_names(module)
    out = []
    for local, param in module.named_parameters():
        if getattr(param, "allreduce", True) is False:
            raise ReshardError(
                f"parameter {local!r} is an expert-parallel parameter: its expert layout is not in megatron's "
                "attributes; override param_layouts() and describe it with ParamLayout(expert=True, ep_dim=...)"
            )
        shape = list(param.shape)
        tp_dim = None
        if getattr(param, "tensor_model_parallel", False):
            tp_dim = int(getattr(param, "partition_dim"))
            shape[tp_dim] *= mesh.size("tp")
        out.append(ParamLayout(
            names[local], tuple(shape), tp_dim=tp_dim, pp_stage=coords.pp_rank,
            tp_stride=int(getattr(param, "partition_stride", 1)) if tp_dim is not None else 1,
            dtype=str(param.dtype).removeprefix("torch."),
        ))
    return out


class MegatronReshardWorker(ReshardWorker):
    """A :class:`ReshardWorker` whose parameters follow megatron-core's conventions (names and tp layouts).

    What ``MegatronWorker`` and the demo's rollout derive from; a plain torch module whose
    parameters carry no tp attributes is described as replicated.
    """

    def reshard_names(self, module: torch.nn.Module) -> dict[str, str]:
        return global_parameter_names(module)

    def reshard_layouts(self) -> list[ParamLayout]:
        return layouts_from_module(self.reshard_module(), self.reshard_mesh(), self.rank)
