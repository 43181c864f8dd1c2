"""The PPO roles of the demo: actor, reference and critic workers (the rollout is in :mod:`.rollout`).

Each is a :class:`MegatronWorker` holding one pipeline stage of the tiny model (its tp shards),
built from the same seed so that every dp replica starts identical.  Training runs the CPU
pipeline (:mod:`rankmesh.megatron.pipeline`), then all-reduces gradients over the dp(-cp) group.

Batch keys (DataProto): ``prompts`` [b, P], ``sample_seed`` [b] -> ``input_ids`` [b, P+R],
``responses``/``rollout_log_probs`` [b, R]; then ``log_probs``, ``ref_log_prob``, ``values``,
``advantages``, ``returns`` [b, R].  ``meta_info["prompt_length"]`` is P.
"""

from __future__ import annotations

import logging
import time
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rankmesh.data.proto import DataProto
from rankmesh.dispatch.modes import Dispatch
from rankmesh.dispatch.register import register
from rankmesh.megatron.model import TinyStage
from rankmesh.megatron.pipeline import run_pipeline
from rankmesh.megatron.reference import ReferenceModel, TinyConfig, sample, shard_dim
from rankmesh.megatron.worker import MegatronWorker

logger = logging.getLogger(__name__)


def _dp_mean(value: float) -> float:
    """Average a float over the dp(-cp) group, so every replica reports the same metric."""
    group = ps.get_data_parallel_group(with_context_parallel=True)
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


class TinyModelWorker(MegatronWorker):
    """A MegatronWorker with one stage of the tiny model and (optionally) an Adam optimizer."""

    value_head = False

    def __init__(self, model: dict | None = None, lr: float = 0.0, micro_batches: int = 2, **kwargs: Any) -> None:
        kwargs.setdefault("backend", "gloo")  # the tiny model lives on CPU, even on a GPU machine
        super().__init__(**kwargs)
        self.cfg = TinyConfig(**(model or {}))
        torch.manual_seed(self.cfg.seed)  # nothing random should depend on the rank
        self.stage = TinyStage.from_seed(self.cfg, value_head=self.value_head)
        self.optimizer = torch.optim.Adam(self.stage.parameters(), lr=lr) if lr > 0 else None
        self.micro_batches = micro_batches

    def reshard_module(self) -> torch.nn.Module:
        """This rank's stage: what ``param_layouts()`` describes and a reshard reads or writes."""
        return self.stage

    # ----- helpers -----------------------------------------------------------------------------

    def _microbatches(self, data: DataProto, keys: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        data = self.to_device(data)  # host->device from the received bytes (nothing on the CPU)
        n = max(1, min(self.micro_batches, len(data)))
        while len(data) % n:  # equal micro-batches keep the loss scaling exact
            n -= 1
        return [{k: part.batch[k] for k in keys} for part in data.chunk(n)]

    def _forward(self, data: DataProto, fn: Callable[[torch.Tensor, dict], torch.Tensor]) -> torch.Tensor | None:
        """Forward-only pipeline; the last stage's per-micro-batch outputs concatenated."""
        self.stage.eval()
        res = run_pipeline(self.stage, self._microbatches(data, ("input_ids",)), fn, self.cfg.hidden_size, forward_only=True)
        return torch.cat(res.outputs) if res.outputs else None

    def _train_step(self, data: DataProto, keys: tuple[str, ...], loss_fn: Callable) -> dict[str, float]:
        """One optimizer step: pipeline forward/backward, dp gradient all-reduce, Adam."""
        assert self.optimizer is not None, "this role was built without an optimizer (lr=0)"
        self.stage.train()
        self.optimizer.zero_grad(set_to_none=False)
        mbs = self._microbatches(data, keys)
        res = run_pipeline(self.stage, mbs, lambda out, mb: loss_fn(out, mb, len(mbs)), self.cfg.hidden_size, forward_only=False)
        self._allreduce_grads()
        grad_norm = self._grad_norm()
        self.optimizer.step()
        metrics: dict[str, float] = {"grad_norm": grad_norm}
        if res.losses:  # last stage: sum the scaled micro-batch losses and their extra metrics
            metrics["loss"] = float(sum(loss.item() for loss in res.losses))
            for extra in res.outputs:
                for k, v in (extra or {}).items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) / len(res.outputs)
        return metrics

    def _allreduce_grads(self) -> None:
        """Average gradients over the dp-cp group (replicas saw different data)."""
        group = ps.get_data_parallel_group(with_context_parallel=True)
        size = dist.get_world_size(group)
        if size == 1:
            return
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)  # one collective, like megatron's DDP buckets
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def _grad_norm(self) -> float:
        """Global gradient norm over the model-parallel (tp x pp) group; replicated weights counted once."""
        tp_rank = ps.get_tensor_model_parallel_rank()
        sq = torch.zeros(1, dtype=torch.float64)
        for name, p in self.stage.named_parameters():
            if p.grad is not None and (shard_dim(name) is not None or tp_rank == 0):
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt().item())

    def _response_slice(self, data: DataProto) -> slice:
        p = int(data.meta_info["prompt_length"])
        return slice(p - 1, None)

    @register(Dispatch.ONE_TO_ALL)
    def gather_full_weights(self) -> dict[str, Any] | None:
        """This stage's full (tp-gathered) weights on tp rank 0, tagged with dp and pp rank."""
        state = self.stage.full_state()  # collective over tp: every rank must call it
        if ps.get_tensor_model_parallel_rank() != 0:
            return None
        return {"dp": ps.get_data_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                "weights": {k: v.numpy() for k, v in state.items()}}


class ActorWorker(TinyModelWorker):
    """The policy: rollout sampling, log-probs and the PPO update."""

    def __init__(self, model: dict | None = None, lr: float = 1e-3, clip_ratio: float = 0.2,
                 ppo_epochs: int = 1, **kwargs: Any) -> None:
        super().__init__(model=model, lr=lr, **kwargs)
        self.clip_ratio, self.ppo_epochs = clip_ratio, ppo_epochs
        self._sampler: ReferenceModel | None = None

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this rank's prompts with the rollout model (one seeded generator per row).

        The rollout model is an unsharded copy of the *initial* policy, standing in for an
        inference engine; log-probs of the sampled tokens come back as ``rollout_log_probs``.
        """
        if self._sampler is None:
            self._sampler = ReferenceModel(self.cfg).eval()
        length = int(prompts.meta_info["response_length"])
        seeds = prompts.batch["sample_seed"].tolist()
        seqs, logps = sample(self._sampler, prompts.batch["prompts"], length, seeds)
        out = DataProto.from_dict(
            {"input_ids": seqs, "responses": seqs[:, -length:], "rollout_log_probs": logps},
            meta_info={**prompts.meta_info, "prompt_length": prompts.batch["prompts"].shape[1]},
        )
        return out

    def _log_probs(self, data: DataProto) -> torch.Tensor | None:
        resp = self._response_slice(data)
        with torch.no_grad():
            return self._forward(data, lambda h, mb: self.stage.log_probs(h, mb["input_ids"])[:, resp])

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """Log-probs of the response tokens under the current policy (3D-parallel forward)."""
        lp = self._log_probs(data)
        return None if lp is None else DataProto.from_dict({"log_probs": lp})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto | None:
        """PPO clipped-surrogate steps; ``loss`` is the first epoch's (pre-update) loss."""
        resp, eps = self._response_slice(data), self.clip_ratio

        def loss_fn(hidden: torch.Tensor, mb: dict, n_mb: int):
            logp = self.stage.log_probs(hidden, mb["input_ids"])[:, resp]
            ratio = torch.exp(logp - mb["old_log_probs"])
            adv = mb["advantages"]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).mean()
            clipfrac = ((ratio - 1).abs() > eps).float().mean().item()
            kl = (mb["old_log_probs"] - logp).mean().item()
            return loss / n_mb, {"pg_clipfrac": clipfrac, "ppo_kl": kl}

        start = time.perf_counter()
        keys = ("input_ids", "old_log_probs", "advantages")
        history = [self._train_step(data, keys, loss_fn) for _ in range(self.ppo_epochs)]
        if not ps.is_pipeline_last_stage():
            return None
        first = history[0]
        metrics = {f"actor/{k}": _dp_mean(v) for k, v in first.items() if k != "loss"}
        metrics["actor/pg_loss"] = _dp_mean(first["loss"])
        metrics["actor/update_s"] = time.perf_counter() - start
        return DataProto(meta_info={"metrics": metrics})

    # ----- the demo's --hang-rank (rankmesh.demo_hang) ---------------------------------------

    _HANG_GROUPS = MappingProxyType({"dp": ps.get_data_parallel_group, "tp": ps.get_tensor_model_parallel_group,
                                     "pp": ps.get_pipeline_model_parallel_group})

    @register(Dispatch.ONE_TO_ALL)
    def hang_in_barrier(self, rank: int, axis: str) -> bool:
        """``rank`` enters a barrier on its ``axis`` group that its peers skip: it blocks until :meth:`release_hang`."""
        if self.rank == rank:
            dist.barrier(group=self._HANG_GROUPS[axis]())
        return self.rank == rank

    @register(Dispatch.ONE_TO_ALL)
    def release_hang(self, rank: int, axis: str) -> bool:
        """The ``axis`` peers of ``rank`` join the barrier it waits in (after :meth:`hang_in_barrier`)."""
        group = self._HANG_GROUPS[axis]()
        if self.rank != rank and rank in dist.get_process_group_ranks(group):
            dist.barrier(group=group)
            return True
        return False


class RefWorker(TinyModelWorker):
    """The frozen reference policy (colocated with the actor: same processes, same parallel_state)."""

    def __init__(self, model: dict | None = None, **kwargs: Any) -> None:
        super().__init__(model=model, lr=0.0, **kwargs)
        for p in self.stage.parameters():
            p.requires_grad_(False)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        resp = self._response_slice(data)
        lp = self._forward(data, lambda h, mb: self.stage.log_probs(h, mb["input_ids"])[:, resp])
        return None if lp is None else DataProto.from_dict({"ref_log_prob": lp})


class CriticWorker(TinyModelWorker):
    """The value model: same body, a replicated value head on the last stage."""

    value_head = True

    def __init__(self, model: dict | None = None, lr: float = 3e-3, ppo_epochs: int = 1, **kwargs: Any) -> None:
        super().__init__(model=model, lr=lr, **kwargs)
        self.ppo_epochs = ppo_epochs

    def _values(self, out: torch.Tensor, data: DataProto) -> torch.Tensor:
        p = int(data.meta_info["prompt_length"])
        return out[:, p - 1 : -1]  # V(state before each response token)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto | None:
        with torch.no_grad():
            v = self._forward(data, lambda out, mb: self._values(out, data))
        return None if v is None else DataProto.from_dict({"values": v})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto | None:
        """Value-regression steps; ``vf_loss`` is the first epoch's (pre-update) loss."""

        def loss_fn(out: torch.Tensor, mb: dict, n_mb: int):
            v = self._values(out, data)
            return 0.5 * (v - mb["returns"]).pow(2).mean() / n_mb, {}

        start = time.perf_counter()
        history = [self._train_step(data, ("input_ids", "returns"), loss_fn) for _ in range(self.ppo_epochs)]
        if not ps.is_pipeline_last_stage():
            return None
        first = history[0]
        metrics = {"critic/vf_loss": _dp_mean(first["loss"]), "critic/grad_norm": _dp_mean(first["grad_norm"])}
        metrics["critic/update_s"] = time.perf_counter() - start
        return DataProto(meta_info={"metrics": metrics})
