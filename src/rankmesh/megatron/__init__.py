"""Megatron-core integration: workers whose process groups come from ``parallel_state``.

``import rankmesh.megatron`` is light: names are loaded on first use, and only the worker-side
modules (``worker``, ``model``, ``pipeline``, ``roles``, ``checkpoint``) import megatron-core (~3 s).  The
controller-side pieces (``check``, ``group``, ``reference``) never do.

* :class:`MegatronWorker` -- torch.distributed + ``initialize_model_parallel`` from the group's mesh.
* :func:`start_megatron_group` / :func:`verify_group` -- start a group and cross-check every rank.
* :func:`compare_reports` / :func:`check_reports` -- the pure comparison behind the check.
* :class:`TinyConfig`, :class:`ReferenceModel` -- the demo model, unsharded.
* :class:`MegatronReshardWorker`, :func:`layouts_from_module`, :func:`global_parameter_names` --
  megatron-core's parameter conventions for :mod:`rankmesh.reshard` (:mod:`.layouts`).
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Mapping

from rankmesh.lazy import lazy_exports

# megatron-core warns at import time, in every process, that the optional fused kernels are
# missing; on CPU that is expected and the warning is noise.
warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
# CUDA-only advice the CPU path triggers on every tensor-parallel layer / config.
warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")

_EXPORTS: Mapping[str, str] = MappingProxyType({
    "MegatronWorker": "rankmesh.megatron.worker",
    "build_report": "rankmesh.megatron.worker",
    "RankReport": "rankmesh.megatron.check",
    "Mismatch": "rankmesh.megatron.check",
    "compare_reports": "rankmesh.megatron.check",
    "check_reports": "rankmesh.megatron.check",
    "expected_report": "rankmesh.megatron.check",
    "start_megatron_group": "rankmesh.megatron.group",
    "check_megatron_group": "rankmesh.megatron.group",
    "verify_group": "rankmesh.megatron.group",
    "collect_reports": "rankmesh.megatron.group",
    "shutdown_megatron_group": "rankmesh.megatron.group",
    "TinyConfig": "rankmesh.megatron.reference",
    "ReferenceModel": "rankmesh.megatron.reference",
    "full_weights": "rankmesh.megatron.reference",
    "MegatronReshardWorker": "rankmesh.megatron.layouts",
    "global_parameter_names": "rankmesh.megatron.layouts",
    "layouts_from_module": "rankmesh.megatron.layouts",
    "ActorWorker": "rankmesh.megatron.roles",
    "RefWorker": "rankmesh.megatron.roles",
    "CriticWorker": "rankmesh.megatron.roles",
})

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
