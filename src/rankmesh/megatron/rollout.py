"""The demo's rollout role: the policy on a generator's layout (tp1·dpN, no pipeline), refit from the actor.

It stands in for an inference engine: every rank holds the whole tiny model, unsharded, in plain
PyTorch (:class:`~rankmesh.megatron.reference.ReferenceModel`), and samples its share of the
prompts.  After every actor update the controller refits it with :func:`rankmesh.reshard.reshard`
from the actor's tp2·pp2·dp2 shards: the weights go from the actor's processes straight into these
ones (read directly on one node, else through the object store), never through the controller.  No megatron-core import here: a
rollout process starts without it.
"""

from __future__ import annotations

from typing import Any

import torch

from rankmesh.data.proto import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.megatron.reference import ReferenceModel, TinyConfig, sample, token_log_probs
from rankmesh.megatron.layouts import MegatronReshardWorker


class RolloutWorker(MegatronReshardWorker):
    """Samples responses with this rank's full copy of the policy; ``self.model`` is what a refit writes."""

    def __init__(self, model: dict | None = None, cpu_threads: int = 1, **_: Any) -> None:
        super().__init__()
        torch.set_num_threads(cpu_threads)  # many ranks share few cores
        self.cfg = TinyConfig(**(model or {}))
        self.model = ReferenceModel(self.cfg).eval()  # the initial policy until the first refit
        for p in self.model.parameters():
            p.requires_grad_(False)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this rank's prompts (one seeded generator per row).

        Returns ``input_ids`` [b, P+R], ``responses`` and their log-probs ``rollout_log_probs`` [b, R],
        each prompt's ``row`` and the ``weight_version`` the rows were made with.
        """
        length = int(prompts.meta_info["response_length"])
        seqs, logps = sample(self.model, prompts.batch["prompts"], length, prompts.batch["sample_seed"].tolist())
        out = DataProto.from_dict(
            {"input_ids": seqs, "responses": seqs[:, -length:], "rollout_log_probs": logps, "row": prompts.batch["row"]},
            meta_info={**prompts.meta_info, "prompt_length": prompts.batch["prompts"].shape[1]},
        )
        return self.stamp_weight_version(out)  # the version of the last refit: which policy made these rows

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences_later(self, prompts: DataProto) -> DataProto:
        """:meth:`generate_sequences` as a non-blocking call: a replica generates while the controller goes on."""
        return self.generate_sequences(prompts)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs of the response tokens of ``input_ids`` under this rank's current weights."""
        ids = data.batch["input_ids"]
        p = int(data.meta_info["prompt_length"])
        with torch.no_grad():
            return DataProto.from_dict({"rollout_log_probs": token_log_probs(self.model(ids), ids)[:, p - 1 :]})
