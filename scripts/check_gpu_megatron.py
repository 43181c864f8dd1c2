#!/usr/bin/env python
"""Check, on a GPU machine, megatron-core's own GPTModel, schedule and optimizer driven through rankmesh.

Why a script and not a test: CI has no GPU, and megatron-core's schedules and its
``DistributedDataParallel`` allocate on ``cuda`` unconditionally (the CPU demo has its own
pipeline for that reason).  This script runs the real stack on one GPU, from the controller,
through a one-rank :class:`~rankmesh.megatron.MegatronWorker` group on nccl:

1. ``model``: megatron-core's ``GPTModel`` in bf16, with the Transformer Engine layer spec when
   ``transformer_engine.pytorch`` imports, else the local spec (printed), wrapped in megatron-core's
   ``DistributedDataParallel``, with the distributed optimizer (``get_megatron_optimizer``,
   ``OptimizerConfig(use_distributed_optimizer=True, bf16=True)``).
2. ``logprobs``: per-token log-probs of a seeded batch, through ``get_forward_backward_func()``
   (forward only, several micro-batches), against an independent fp32 reference: a plain-PyTorch
   GPT written below (no megatron code) evaluated on the controller's CPU from the rank's bf16
   weights.  Tolerance: :func:`logprob_tolerance` (derived there from bf16's 8-bit significand).
3. ``ppo``: one PPO clipped-ratio update through the same schedule (forward and backward over the
   micro-batches, DDP's gradient reduction, the distributed optimizer's step).  Expected from first
   principles: at ratio 1 the surrogate's gradient is the policy gradient, so one small step must
   raise the surrogate ``mean(ratio * advantage)`` above its value at the old policy (``mean(A)``).
4. ``speed``: tokens/s of the training step (median of ``--steps``) and peak GPU memory
   (``torch.cuda.max_memory_allocated``).
5. ``device``: ``torch.cuda.current_device()`` inside a call on the session path (rankmesh's
   default carrier of blocking calls, run on the rank's session thread) equals the one on the Ray
   path (``wg.set_control("ray")``: Ray's own thread).  CUDA's current device is per thread.
6. ``shared_gpu``: two nccl ranks on the one GPU (a pool that asks Ray for no GPU) must be refused
   when the group starts, with an error naming the ranks and the device, not hang in NCCL.

Every check is wrapped: a failure prints FAIL with its traceback and the next check runs, so one
run yields every figure.  ``--timeout`` ends the whole run (exit 3) if something hangs.  The last
block is ``key: value`` lines to paste into docs.  Exit status 0 when every check holds.

Without CUDA (or with ``--cpu``) it runs as a smoke test of the plumbing: gloo, tiny sizes, bf16 on
the CPU, and, where megatron-core hard-codes CUDA (its schedules, DDP, the distributed optimizer),
a plain loop over the same step functions and ``torch.optim.Adam``; check 6 is skipped.

    python scripts/check_gpu_megatron.py                # GPU: hidden 1024, 8 layers, seq 1024, 8 micro-batches
    python scripts/check_gpu_megatron.py --cpu          # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import math
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.megatron import MegatronWorker  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402

#: Model and batch sizes: ~0.17 B parameters and 8 x 1024 tokens per step on the GPU; tiny on the CPU.
SIZES = {
    "gpu": dict(vocab=32768, hidden=1024, layers=8, heads=16, seq=1024, micro_batches=8, micro_batch_size=1),
    "cpu": dict(vocab=256, hidden=64, layers=2, heads=4, seq=32, micro_batches=4, micro_batch_size=2),
}
#: Adam's first step moves every weight by ~lr.  On the GPU the bf16 weights are copies of fp32 master
#: weights (~0.02): a step under half a bf16 spacing there (~4e-5) would leave most of them unchanged.
#: The CPU's torch Adam updates its bf16 weights directly.
LR = {"gpu": 1e-4, "cpu": 1e-3}
#: Variables megatron-core wants before CUDA starts (one hardware queue keeps its tp comm ordered).
WORKER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits (7 stored + 1 implicit)
ROUNDINGS_PER_LAYER = 6  # layer norm, qkv, attention, proj, fc1, fc2: one bf16 rounding each
CLIP = 0.2


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    seq: int
    micro_batches: int
    micro_batch_size: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq


def batch(sizes: Sizes, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [M, b, s] and advantages [M, b, s-1], seeded: the rank and the controller draw the same."""
    g = torch.Generator().manual_seed(seed)
    shape = (sizes.micro_batches, sizes.micro_batch_size, sizes.seq)
    ids = torch.randint(0, sizes.vocab, shape, generator=g)
    adv = torch.randn(shape[:-1] + (sizes.seq - 1,), generator=g)
    return ids, adv


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) in fp32, [b, s-1], from logits [b, s, V]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


# ----- the independent reference: GPT in plain PyTorch, fp32, from megatron's state dict -------

#: Transformer Engine's fused layers hold the layer norms inside the next linear: their names in
#: the local spec, which the reference reads.
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def local_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the local spec's names (TE's fused names renamed, ``_extra_state`` dropped)."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        for te, local in TE_TO_LOCAL.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = value
    return out


def reference_log_probs(state: dict[str, torch.Tensor], sizes: Sizes, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-token log-probs [b, s-1] of a pre-norm GPT with learned positions, in fp32, and max |logit|.

    Written from the architecture, not from megatron's code: fused qkv laid out per head as
    [q, k, v] (megatron's ``SelfAttention`` with one query group per head), causal softmax
    attention scaled by 1/sqrt(head_dim), exact GeLU MLP, final layer norm, untied output layer.
    """
    w = {k: v.float() for k, v in local_names(state).items()}
    h, nh = sizes.hidden, sizes.heads
    hd = h // nh
    b, s = ids.shape
    x = w["embedding.word_embeddings.weight"][ids] + w["embedding.position_embeddings.weight"][:s]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(sizes.layers):
        p = f"decoder.layers.{i}."
        y = F.layer_norm(x, (h,), w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], eps=1e-5)
        qkv = F.linear(y, w[p + "self_attention.linear_qkv.weight"], w[p + "self_attention.linear_qkv.bias"])
        q, k, v = qkv.view(b, s, nh, 3, hd).permute(3, 0, 2, 1, 4)  # each [b, nh, s, hd]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        attn = attn.transpose(1, 2).reshape(b, s, h)
        x = x + F.linear(attn, w[p + "self_attention.linear_proj.weight"], w[p + "self_attention.linear_proj.bias"])
        y = F.layer_norm(x, (h,), w[p + "pre_mlp_layernorm.weight"], w[p + "pre_mlp_layernorm.bias"], eps=1e-5)
        y = F.gelu(F.linear(y, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]))
        x = x + F.linear(y, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])
    x = F.layer_norm(x, (h,), w["decoder.final_layernorm.weight"], w["decoder.final_layernorm.bias"], eps=1e-5)
    logits = x @ w["output_layer.weight"].t()
    return token_log_probs(logits, ids), float(logits.abs().max())


def logprob_tolerance(sizes: Sizes, max_abs_logit: float) -> float:
    """Bound on |log p_bf16 - log p_fp32| per token, from bf16's unit roundoff u = 2^-8.

    log p_t = z_t - logsumexp(z), and logsumexp moves by at most max_j |dz_j|, so
    |d log p_t| <= 2 max_j |dz_j|.  Each bf16 rounding perturbs a value by a relative u at most;
    a pre-norm residual stream carries each layer's ``ROUNDINGS_PER_LAYER`` roundings to the end
    with gain ~1 (small-init sublayers, normalized inputs), and independent rounding errors add
    like a random walk, so the final hidden state is off by ~sqrt(L * R) * u relative, and the
    logits (one more rounding to bf16) by (sqrt(L * R) + 1) * u * max|z|.  For 8 layers that is
    ~7.9 u = 3.1 % of the largest logit; a wrong weight, layout or mask moves log-probs by the
    logits' own spread (~max|z| / 3), an order of magnitude more.
    """
    relative = (math.sqrt(sizes.layers * ROUNDINGS_PER_LAYER) + 1.0) * BF16_UNIT_ROUNDOFF
    return 2.0 * relative * max_abs_logit


# ----- the rank -----------------------------------------------------------------------------


def layer_spec(cuda: bool) -> tuple[Any, str]:
    """Transformer Engine's layer spec when ``transformer_engine.pytorch`` imports, else the local one.

    Without CUDA the local spec's core attention is swapped for :class:`CpuCoreAttention`:
    megatron's ``DotProductAttention`` takes its score buffer from a global buffer on ``cuda``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if not cuda:
        spec = specs.get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = _cpu_core_attention_class()
        return spec, "local, core attention in plain torch (no CUDA)"
    try:
        import transformer_engine.pytorch  # noqa: F401

        return specs.get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
    except Exception as exc:  # noqa: BLE001 - any import failure means: no TE here
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
        return specs.get_gpt_layer_local_spec(), f"local (transformer_engine.pytorch: {reason})"


def _cpu_core_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class CpuCoreAttention(MegatronModule):
        """Causal softmax attention for the CPU smoke test; megatron's ``DotProductAttention``'s interface."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any) -> None:
            super().__init__(config=config)

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
            # [s, b, heads, head_dim] -> [b, heads, s, head_dim] and back to [s, b, heads * head_dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(query.dtype)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return CpuCoreAttention


class GPTCheck(MegatronWorker):
    """One rank of megatron-core's GPTModel, its schedule, DDP and distributed optimizer."""

    def __init__(self, sizes: dict[str, int], seed: int, backend: str | None = None) -> None:
        super().__init__(backend=backend)
        self.sizes = Sizes(**sizes)
        self.seed = seed
        self.cuda = self.device.type == "cuda"
        self.lr = LR["gpu" if self.cuda else "cpu"]
        self.ids, self.adv = batch(self.sizes, seed)
        self.old_logp: torch.Tensor | None = None

    @register(Dispatch.ONE_TO_ALL)
    def build(self) -> dict[str, Any]:
        """GPTModel (bf16) + DDP + distributed optimizer on the GPU; GPTModel + torch Adam on the CPU."""
        import megatron.core
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        sz = self.sizes
        torch.manual_seed(self.seed)
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        spec, spec_name = layer_spec(self.cuda)
        self.config = TransformerConfig(
            num_layers=sz.layers, hidden_size=sz.hidden, num_attention_heads=sz.heads, ffn_hidden_size=4 * sz.hidden,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
            use_cpu_initialization=not self.cuda, sequence_parallel=False,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        )
        model = GPTModel(
            config=self.config, transformer_layer_spec=spec, vocab_size=sz.vocab, max_sequence_length=sz.seq,
            position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
        ).to(self.device)
        self.module = model  # the bare GPTModel (state dict names as the reference reads them)
        params = sum(p.numel() for p in model.parameters())
        # As megatron's training loop does for bf16: bf16 parameters and inputs, fp32 logits out.
        model = Float16Module(self.config, model)
        if self.cuda:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            )
            self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=model)
            self.config.no_sync_func = self.model.no_sync
            self.config.finalize_model_grads_func = _finalize_model_grads()
            self.optimizer = get_megatron_optimizer(
                _optimizer_config(OptimizerConfig, lr=self.lr, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                                  use_distributed_optimizer=True, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999),
                [self.model],
            )
            self.config.grad_scale_func = self.optimizer.scale_loss  # as megatron's training loop sets it
            optimizer = f"{type(self.optimizer).__name__} ({', '.join(type(o).__name__ for o in _inner_optimizers(self.optimizer))})"
            schedule = "megatron get_forward_backward_func (forward_backward_no_pipelining)"
        else:
            self.model = model
            self.optimizer = torch.optim.Adam(model.parameters(), lr=self.lr, betas=(0.9, 0.999))
            optimizer = "torch.optim.Adam (CPU: megatron's DDP and distributed optimizer allocate on cuda)"
            schedule = "plain loop over the same step functions (CPU: megatron's schedules allocate on cuda)"
        return {
            "megatron_core": megatron.core.__version__, "torch": torch.__version__, "spec": spec_name,
            "parameters": params, "device": str(self.device), "backend": self._backend,
            "optimizer": optimizer, "schedule": schedule,
            "device_name": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
        }

    @register(Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        """The bf16 weights the model computes with, on the CPU (for the controller's reference)."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items() if torch.is_tensor(v)}

    # -- the step functions megatron's schedule calls --------------------------------------------

    def _micro_batches(self) -> Any:
        for i in range(self.sizes.micro_batches):
            yield i

    def _forward_step(self, ppo: bool) -> Callable[[Any, Any], Any]:
        s = self.sizes.seq
        mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=self.device).triu(1)  # True: masked out
        positions = torch.arange(s, device=self.device).unsqueeze(0).expand(self.sizes.micro_batch_size, s)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            i = next(data_iterator)
            ids = self.ids[i].to(self.device)
            logits = model(ids, positions, mask)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                logp = token_log_probs(output, ids)
                if not ppo:
                    return logp.sum() * 0.0, {"logp": logp.detach()}
                ratio = torch.exp(logp - self.old_logp[i].to(self.device))
                adv = self.adv[i].to(self.device)
                loss = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
                return loss, {"loss": loss.detach().clone()}  # the schedule scales ``loss`` in place

            return logits, loss_func

        return forward_step

    def _run_schedule(self, ppo: bool, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        step = self._forward_step(ppo)
        if self.cuda:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=self._micro_batches(), model=[self.model],
                num_microbatches=self.sizes.micro_batches, seq_length=self.sizes.seq,
                micro_batch_size=self.sizes.micro_batch_size, forward_only=forward_only,
            )
        store = []  # megatron's forward_backward_no_pipelining, without its cuda allocations
        data = self._micro_batches()
        for _ in range(self.sizes.micro_batches):
            output, loss_func = step(data, self.model)
            loss, info = loss_func(output)
            if not forward_only:
                (loss / self.sizes.micro_batches).backward()
            store.append(info)
        return store

    def _log_probs(self) -> torch.Tensor:
        self.model.eval()
        with torch.no_grad():
            out = self._run_schedule(ppo=False, forward_only=True)
        self.model.train()
        return torch.stack([o["logp"].float().cpu() for o in out])

    def _train_step(self) -> tuple[float, float]:
        """One update (forward+backward over the micro-batches, optimizer step): (mean loss, grad norm)."""
        if self.cuda:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run_schedule(ppo=True, forward_only=False)
        if self.cuda:
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("rank 0: the distributed optimizer skipped its step (non-finite gradients)")
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
            self.optimizer.step()
        return float(torch.stack([o["loss"] for o in out]).mean()), float(grad_norm)

    @register(Dispatch.ONE_TO_ALL)
    def log_probs(self) -> torch.Tensor:
        """Per-token log-probs [M, b, s-1] of the seeded batch, through the schedule (forward only)."""
        self.old_logp = self._log_probs()
        return self.old_logp

    @register(Dispatch.ONE_TO_ALL)
    def ppo_update(self) -> dict[str, float]:
        """One PPO clipped-ratio update against the log-probs of :meth:`log_probs`; the surrogate before and after."""
        if self.old_logp is None:
            raise RuntimeError("rank 0: ppo_update needs the old log-probs: call log_probs first")
        loss, grad_norm = self._train_step()
        new = self._log_probs()
        ratio = torch.exp(new - self.old_logp)
        return {
            "loss": loss, "grad_norm": grad_norm,
            "surrogate_before": float(self.adv.mean()), "surrogate_after": float((ratio * self.adv).mean()),
            "mean_abs_advantage": float(self.adv.abs().mean()), "lr": self.lr,
            "max_abs_logp_change": float((new - self.old_logp).abs().max()),
        }

    @register(Dispatch.ONE_TO_ALL)
    def speed(self, steps: int) -> dict[str, float]:
        """Median seconds of a training step over ``steps`` (after one warm-up), tokens/s, peak GPU memory."""
        times = []
        for i in range(steps + 1):
            _sync(self.cuda)
            t0 = time.perf_counter()
            self._train_step()
            _sync(self.cuda)
            if i:
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        return {
            "step_s": step, "tokens_per_s": self.sizes.tokens_per_step / step,
            "peak_gpu_mib": torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else float("nan"),
        }

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        """The CUDA device and the thread this call runs on."""
        return {
            "thread": threading.current_thread().name,
            "current_device": torch.cuda.current_device() if self.cuda else None,
            "chosen_device": self.device.index,
        }


def _finalize_model_grads() -> Callable:
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads


def _optimizer_config(cls: Any, **kwargs: Any) -> Any:
    """``cls(**kwargs)`` keeping only the fields this megatron-core version has (0.16-0.19 differ)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kwargs.items() if k in names})


def _inner_optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class SharedGPU(MegatronWorker):
    """A bare MegatronWorker: its start is what check 6 is about."""


# ----- the controller ------------------------------------------------------------------------


class Checks:
    """Runs each check, records PASS/FAIL (with the traceback) and the figures for the summary."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str]] = []
        self.figures: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            status = "PASS"
        except Exception:  # noqa: BLE001 - report and go on to the next check
            status = "FAIL"
            print(f"--- {name} failed:\n{traceback.format_exc()}", flush=True)
        self.results.append((name, status))
        print(f"[{status}] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def summary(self) -> list[str]:
        """The checks' verdicts, the figures as ``key: value`` lines, and the failed checks."""
        print("\n===== summary =====")
        for name, status in self.results:
            print(f"check {name}: {status}")
        for key, value in self.figures.items():
            print(f"{key}: {value}")
        failed = [n for n, s in self.results if s == "FAIL"]
        print("PASS" if not failed else f"FAIL: {', '.join(failed)}", flush=True)
        return failed

    def abandon(self, timeout: float) -> None:
        """``--timeout`` passed: every thread's stack, what was measured so far, exit 3."""
        print(f"\nTIMEOUT: the run exceeded --timeout {timeout:.0f} s; stacks of every thread:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        self.results.append(("timeout", "FAIL"))
        self.summary()
        os._exit(3)

    def skip(self, name: str, why: str) -> None:
        self.results.append((name, f"SKIP ({why})"))
        print(f"[SKIP] {name}: {why}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="smoke test on the CPU (the default without CUDA)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (after one warm-up)")
    ap.add_argument("--ref-rows", type=int, default=2, help="sequences compared with the fp32 CPU reference")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds before the whole run is abandoned (exit 3)")
    ap.add_argument("--seed", type=int, default=1234)
    for key in SIZES["gpu"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override {key}")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    kind = "gpu" if cuda else "cpu"
    sizes = Sizes(**{k: getattr(args, k) or v for k, v in SIZES[kind].items()})
    backend = "nccl" if cuda else "gloo"
    t_start = time.perf_counter()
    checks = Checks()
    fig = checks.figures
    watchdog = threading.Timer(args.timeout, checks.abandon, args=(args.timeout,))
    watchdog.daemon = True
    watchdog.start()
    ensure_ray(num_cpus=max(4, os.cpu_count() or 4))
    print(f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'CPU smoke test (no CUDA or --cpu)'}")
    print(f"sizes: {sizes}")
    fig.update(mode=kind, backend=backend, hidden=sizes.hidden, layers=sizes.layers, heads=sizes.heads,
               vocab=sizes.vocab, seq=sizes.seq, micro_batches=sizes.micro_batches,
               micro_batch_size=sizes.micro_batch_size, tokens_per_step=sizes.tokens_per_step)

    group: dict[str, Any] = {}

    def start() -> None:
        pool = RayResourcePool([1], use_gpu=cuda)
        t0 = time.perf_counter()
        group["wg"] = RayWorkerGroup(pool, RayClassWithInitArgs(GPTCheck, dataclasses.asdict(sizes), args.seed, backend),
                                     mesh=RankMesh(), worker_env=WORKER_ENV)
        info = group["wg"].build()[0]
        fig["group_start_and_build_s"] = round(time.perf_counter() - t0, 1)
        print(f"rank 0: {info}")
        fig.update(megatron_core=info["megatron_core"], torch=info["torch"], device=info["device_name"],
                   layer_spec=info["spec"], parameters=info["parameters"], optimizer=info["optimizer"],
                   schedule=info["schedule"])

    def logprobs() -> None:
        wg = group["wg"]
        got = wg.log_probs()[0]  # [M, b, s-1]
        ids, _ = batch(sizes, args.seed)
        rows = ids.reshape(-1, sizes.seq)[: args.ref_rows]
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            want, max_logit = reference_log_probs(wg.weights()[0], sizes, rows)
        finally:
            torch.set_num_threads(threads)
        fig["reference_cpu_s"] = round(time.perf_counter() - t0, 1)
        diff = (got.reshape(-1, sizes.seq - 1)[: args.ref_rows] - want).abs()
        tol = logprob_tolerance(sizes, max_logit)
        fig.update(logprob_max_abs_diff=f"{float(diff.max()):.4g}", logprob_mean_abs_diff=f"{float(diff.mean()):.4g}",
                   logprob_tolerance=f"{tol:.4g}", reference_max_abs_logit=f"{max_logit:.4g}",
                   reference_logprob_std=f"{float(want.std()):.4g}", compared_tokens=diff.numel())
        print(f"log-probs vs fp32 CPU reference over {diff.numel()} tokens: max |diff| {float(diff.max()):.4g}, "
              f"mean {float(diff.mean()):.4g}, tolerance {tol:.4g} (max |logit| {max_logit:.4g})")
        if not torch.isfinite(got).all():
            raise AssertionError("non-finite log-probs from the rank")
        if float(diff.max()) > tol:
            raise AssertionError(f"log-probs differ from the fp32 reference by {float(diff.max()):.4g} > {tol:.4g}")

    def ppo() -> None:
        r = group["wg"].ppo_update()[0]
        fig.update(ppo_loss=f"{r['loss']:.5g}", ppo_grad_norm=f"{r['grad_norm']:.4g}",
                   surrogate_before=f"{r['surrogate_before']:.5g}", surrogate_after=f"{r['surrogate_after']:.5g}",
                   ppo_max_abs_logp_change=f"{r['max_abs_logp_change']:.4g}")
        print(f"PPO update: {r}")
        if not all(math.isfinite(v) for v in r.values()):
            raise AssertionError(f"non-finite PPO figures: {r}")
        # The first update's ratios are exp(logp - old logp) of the same weights, i.e. 1: its loss is -mean(A).
        if abs(r["loss"] + r["surrogate_before"]) > 0.01 * r["mean_abs_advantage"]:
            raise AssertionError(f"first PPO loss {r['loss']:.6g} is not -mean(advantage) = {-r['surrogate_before']:.6g}")
        if not r["surrogate_after"] > r["surrogate_before"]:
            raise AssertionError(f"the update did not raise the surrogate: {r['surrogate_before']:.5g} -> {r['surrogate_after']:.5g}")

    def speed() -> None:
        r = group["wg"].speed(args.steps)[0]
        fig.update(train_step_s=f"{r['step_s']:.4f}", train_tokens_per_s=f"{r['tokens_per_s']:.0f}",
                   peak_gpu_mib=f"{r['peak_gpu_mib']:.0f}")
        print(f"training step: {r}")

    def device() -> None:
        wg = group["wg"]
        wg.set_control("auto")
        on_session = wg.where()[0]
        path_a = wg.transport_info()[0]["control"]
        wg.set_control("ray")
        try:
            on_ray = wg.where()[0]
            path_b = wg.transport_info()[0]["control"]
        finally:
            wg.set_control("auto")
        print(f"session path ({path_a}): {on_session}\nray path ({path_b}): {on_ray}")
        fig.update(session_thread=on_session["thread"], session_device=on_session["current_device"],
                   ray_thread=on_ray["thread"], ray_device=on_ray["current_device"])
        if path_a != "session" or path_b != "ray":
            raise AssertionError(f"expected the session then the ray carrier, the group reports {path_a!r} then {path_b!r}")
        if on_session["thread"] == on_ray["thread"]:
            raise AssertionError(f"both calls ran on thread {on_ray['thread']!r}: the carriers were not exercised")
        if on_session["current_device"] != on_ray["current_device"] or on_ray["current_device"] != on_ray["chosen_device"]:
            raise AssertionError(f"current device differs: session {on_session}, ray {on_ray}")

    def shared_gpu() -> None:
        t0 = time.perf_counter()
        try:
            wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(SharedGPU, backend="nccl"),
                                mesh=RankMesh(dp=2), worker_env=WORKER_ENV)
        except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
            text = str(exc)
            fig["shared_gpu_refused_s"] = round(time.perf_counter() - t0, 1)
            print(f"two nccl ranks on one GPU refused after {time.perf_counter() - t0:.1f} s:\n{text[:1500]}")
            if "ranks [0, 1]" not in text or "own GPU" not in text:
                raise AssertionError("the refusal does not name both ranks and the fix") from exc
            return
        wg.shutdown()
        raise AssertionError("two nccl ranks on one GPU started without an error")

    checks.run("start+build", start)
    if "wg" in group:
        checks.run("logprobs-vs-fp32-reference", logprobs)
        checks.run("ppo-update", ppo)
        checks.run("speed", speed)
        checks.run("device-session-vs-ray", device)
        group["wg"].shutdown()
    if cuda:
        checks.run("shared-gpu-refused", shared_gpu)
    else:
        checks.skip("shared-gpu-refused", "needs CUDA (nccl)")
    fig["total_s"] = round(time.perf_counter() - t_start, 1)

    watchdog.cancel()
    failed = checks.summary()
    import ray

    ray.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
