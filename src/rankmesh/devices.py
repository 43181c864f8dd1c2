"""Devices of worker processes: ROCm's variables unified with CUDA's, Ray's local-rank rule, one rank per GPU under nccl.

Why in the core: AMD clusters run Megatron too, and PyTorch's ROCm build reads
``CUDA_VISIBLE_DEVICES`` like the CUDA build does, while ROCm tools set ``HIP_VISIBLE_DEVICES``
or ``ROCR_VISIBLE_DEVICES``.  Unifying them into ``CUDA_VISIBLE_DEVICES`` before anything
reads them gives every worker one variable to trust (verl's ``Worker`` does the same):

* ``HIP_VISIBLE_DEVICES`` becomes ``CUDA_VISIBLE_DEVICES``; both set to different values is an
  error (which one should win is a guess);
* ``ROCR_VISIBLE_DEVICES`` becomes ``CUDA_VISIBLE_DEVICES``; set together with HIP's or CUDA's
  it is an error (ROCR filters first and HIP indexes what is left: two meanings of "device 0");
* with a ``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES`` flag Ray leaves the visibility variable
  alone, so every process sees all devices and must select its own: ``LOCAL_RANK`` becomes the
  first accelerator id Ray assigned to the process, and the caller selects that device.

:func:`unify_visible_devices` is pure (an environment in, the changes out) so it is tested on
CPU by passing variables; the worker host applies the changes to ``os.environ``.

NCCL cannot put two ranks of one communicator on one GPU: depending on its version it fails in
the first collective with ``invalid usage`` ("Duplicate GPU detected"), deep inside whatever ran
it, or the other ranks wait in that collective until their timeout.  A pool that asks Ray for no
GPUs on a one-GPU machine is enough to get there.  :func:`check_one_rank_per_gpu` is the rule,
pure for the same reason: every rank's :class:`RankDevice` in, an error naming the ranks, the GPU
and the fix out; ``MegatronWorker`` gathers the records (over gloo) and applies it before any
nccl collective runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from rankmesh.errors import RendezvousError

#: Ray's flags that stop it setting a device-visibility variable, and the resource each names.
RAY_NOSET_FLAGS: Mapping[str, str] = MappingProxyType({
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "GPU",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "GPU",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "GPU",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "NPU",
})


@dataclass(frozen=True)
class DeviceEnv:
    """What to change in a worker's environment: variables to set and to remove, the device to select."""

    set: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    device_index: int | None = None


def ray_noset_resource(env: Mapping[str, str]) -> str | None:
    """The accelerator resource whose visibility Ray was told not to set (``"GPU"``...), or None."""
    for flag, resource in RAY_NOSET_FLAGS.items():
        if env.get(flag, "").strip().lower() in ("1", "true", "yes"):
            return resource
    return None


def unify_visible_devices(
    env: Mapping[str, str], accelerator_ids: Mapping[str, Sequence[str]] | None = None
) -> DeviceEnv:
    """The changes that make ``CUDA_VISIBLE_DEVICES`` the one visibility variable of ``env``.

    ``accelerator_ids`` is what Ray assigned to the process (``{"GPU": ["3"]}``); it is read only
    when a ``RAY_EXPERIMENTAL_NOSET_*`` flag is set.  Raises :class:`RendezvousError` (a
    ``RuntimeError``) naming the variables when they contradict each other.
    """
    hip, rocr, cuda = (env.get(k) or None for k in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))
    to_set: dict[str, str] = {}
    unset: list[str] = []
    if hip:
        if cuda and hip != cuda:
            raise RendezvousError(
                f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; set one of them "
                f"(or both to the same devices)"
            )
        unset.append("HIP_VISIBLE_DEVICES")
        cuda = cuda or hip
        to_set["CUDA_VISIBLE_DEVICES"] = cuda
    if rocr:
        if cuda:
            raise RendezvousError(
                f"ROCR_VISIBLE_DEVICES={rocr!r} is set together with HIP/CUDA_VISIBLE_DEVICES={cuda!r}; "
                f"they filter devices at different levels, so set only one of them"
            )
        unset.append("ROCR_VISIBLE_DEVICES")
        to_set["CUDA_VISIBLE_DEVICES"] = rocr
    device_index = None
    resource = ray_noset_resource(env)
    if resource is not None:
        ids = list((accelerator_ids or {}).get(resource) or [])
        if not ids:
            raise RendezvousError(
                f"a RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES flag is set but Ray assigned this process no "
                f"{resource}; give the worker group's pool {resource}s (use_gpu=True) or unset the flag"
            )
        to_set["LOCAL_RANK"] = str(ids[0])
        device_index = int(ids[0]) if resource == "GPU" else None  # the caller selects CUDA devices only
    return DeviceEnv(set=to_set, unset=tuple(unset), device_index=device_index)


@dataclass(frozen=True)
class RankDevice:
    """The GPU one rank computes on: ``gpu`` names the physical device uniquely (its UUID where the
    driver gives one), ``index`` is the rank's own ``cuda:<index>``, ``node`` its host, for the message."""

    rank: int
    node: str
    gpu: str
    index: int


def ranks_sharing_gpus(devices: Sequence[RankDevice]) -> list[list[RankDevice]]:
    """Every set of two or more ranks on one physical GPU, each in rank order, ordered by their first rank."""
    by_gpu: dict[str, list[RankDevice]] = defaultdict(list)
    for device in sorted(devices, key=lambda d: d.rank):
        by_gpu[device.gpu].append(device)
    return sorted((ranks for ranks in by_gpu.values() if len(ranks) > 1), key=lambda ranks: ranks[0].rank)


def check_one_rank_per_gpu(backend: str, devices: Sequence[RankDevice]) -> None:
    """Raise :class:`RendezvousError` when ``backend`` is nccl and two ranks share a GPU.

    The message names every such set of ranks, the GPU (cuda index, node, identity) and the two
    fixes: one GPU per rank, or gloo (other backends accept shared devices; the rule is nccl's).
    """
    if backend != "nccl":
        return
    shared = ranks_sharing_gpus(devices)
    if not shared:
        return
    sets = "; ".join(
        f"ranks {[d.rank for d in ranks]} all use GPU {ranks[0].gpu} "
        f"({', '.join(sorted({f'cuda:{d.index}' for d in ranks}))}) on node {ranks[0].node}"
        for ranks in shared
    )
    raise RendezvousError(
        f"nccl needs every rank on its own GPU, but {sets}: NCCL would refuse the group in its first "
        f"collective or leave the other ranks waiting there. Give each rank its own GPU (a "
        f"RayResourcePool(..., use_gpu=True) gives every rank one), or use gloo (backend=\"gloo\": the "
        f"ranks then compute on the CPU)"
    )


__all__ = [
    "DeviceEnv", "RAY_NOSET_FLAGS", "RankDevice", "check_one_rank_per_gpu", "ranks_sharing_gpus",
    "ray_noset_resource", "unify_visible_devices",
]
