"""The tiny causal LM built from megatron-core tensor-parallel layers, one pipeline stage per rank.

Attention q/k/v and the first MLP layer are ``ColumnParallelLinear`` (each tp rank owns some heads
and some hidden units), their outputs go through ``RowParallelLinear`` (partial sums all-reduced
over the tp group), the embedding is a ``VocabParallelEmbedding`` and the LM head a column-parallel
projection whose vocab-sharded logits feed megatron's ``vocab_parallel_cross_entropy``.  Layer
norms and the critic's value head are replicated across tp.

Weights are never initialized here: :meth:`TinyStage.load_full` slices every shard from the full
tensors of :func:`rankmesh.megatron.reference.full_weights`, so the model is the same numbers for
any (tp, pp) split, and every dp replica starts identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig

from rankmesh.megatron.reference import TinyConfig, causal_attention, full_weights, shard_dim


def megatron_config(cfg: TinyConfig) -> TransformerConfig:
    """A TransformerConfig for CPU: CPU init, no fused kernels, no sequence parallelism."""
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        use_cpu_initialization=True,  # the tiny model lives on CPU (see docs/megatron.md for GPU)
        perform_initialization=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        sequence_parallel=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layer indices pipeline stage ``pp_rank`` owns (contiguous, earlier stages get extras)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def _identity_init(_: torch.Tensor) -> None:
    """Weights are loaded from the full tensors afterwards; megatron asks for an init method anyway."""


class ParallelLayer(torch.nn.Module):
    """One pre-norm transformer layer with tensor-parallel attention and MLP."""

    def __init__(self, cfg: TinyConfig, mcfg: TransformerConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.head_dim = cfg.head_dim
        col = dict(config=mcfg, init_method=_identity_init, bias=True, gather_output=False)
        row = dict(config=mcfg, init_method=_identity_init, bias=True, input_is_parallel=True, skip_bias_add=False)
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.q = tensor_parallel.ColumnParallelLinear(h, h, **col)
        self.k = tensor_parallel.ColumnParallelLinear(h, h, **{**col, "bias": False})  # see reference.py
        self.v = tensor_parallel.ColumnParallelLinear(h, h, **col)
        self.proj = tensor_parallel.RowParallelLinear(h, h, **row)
        self.fc1 = tensor_parallel.ColumnParallelLinear(h, f, **col)
        self.fc2 = tensor_parallel.RowParallelLinear(f, h, **row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        attn = causal_attention(self.q(y)[0], self.k(y)[0], self.v(y)[0], self.head_dim)
        x = x + self.proj(attn)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))[0]))[0]


class TinyStage(torch.nn.Module):
    """This rank's slice of the model: its pipeline stage's layers, its tensor-parallel shards.

    The first stage maps token ids to hidden states; the last stage maps hidden states to
    vocab-parallel logits (or to values, for a critic).  ``forward`` takes what this stage receives
    (token ids on the first stage, hidden states otherwise) and returns what it produces.
    """

    def __init__(self, cfg: TinyConfig, value_head: bool = False) -> None:
        super().__init__()
        self.cfg, self.value_head = cfg, value_head
        mcfg = megatron_config(cfg)
        pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        if cfg.num_heads % ps.get_tensor_model_parallel_world_size():
            raise ValueError(f"num_heads={cfg.num_heads} is not divisible by tp={ps.get_tensor_model_parallel_world_size()}")
        h = cfg.hidden_size
        if self.is_first:
            self.embed = tensor_parallel.VocabParallelEmbedding(cfg.vocab_size, h, init_method=_identity_init, config=mcfg)
        self.layers = torch.nn.ModuleDict(
            {str(i): ParallelLayer(cfg, mcfg) for i in stage_layers(cfg.num_layers, pp_size, pp_rank)}
        )
        if self.is_last:
            self.final_ln = torch.nn.LayerNorm(h)
            if value_head:
                self.value = torch.nn.Linear(h, 1)
            else:
                self.head = tensor_parallel.ColumnParallelLinear(
                    h, cfg.vocab_size, config=mcfg, init_method=_identity_init, bias=False, gather_output=False
                )

        self._mark_tensor_parallel()

    def _mark_tensor_parallel(self) -> None:
        """Set megatron's tp attributes on every sharded weight that lacks them.

        megatron-core's parallel layers set ``tensor_model_parallel`` / ``partition_dim`` /
        ``partition_stride`` on a weight only inside their weight-initialization paths, which this
        model skips (``perform_initialization=False``: weights come from :meth:`load_full`);
        :mod:`rankmesh.reshard` reads the attributes to describe the parameters.
        """
        for name, param in self.named_parameters():
            dim = shard_dim(name)
            if dim is not None and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, True, dim, 1)

    @torch.no_grad()
    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of every weight out of the full tensors."""
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        for name, param in self.named_parameters():
            full = weights[name]
            dim = shard_dim(name)
            piece = full if dim is None else full.chunk(tp, dim=dim)[rank]
            if piece.shape != param.shape:
                raise ValueError(f"{name}: shard {tuple(piece.shape)} does not fit parameter {tuple(param.shape)}")
            param.copy_(piece)

    @classmethod
    def from_seed(cls, cfg: TinyConfig, value_head: bool = False, seed: int | None = None) -> "TinyStage":
        stage = cls(cfg, value_head=value_head)
        stage.load_full(full_weights(cfg, seed, value_head=value_head))
        return stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if not self.is_last:
            return x
        x = self.final_ln(x)
        if self.value_head:
            return self.value(x).squeeze(-1)
        return x  # hidden states; the LM head runs in log_probs() on the positions that need it

    def log_probs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t+1] | ...) from the last stage's hidden states: [b, s-1] (vocab-parallel)."""
        logits = self.head(hidden[:, :-1])[0]
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, tokens[:, 1:].contiguous())

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """This stage's weights with tp shards gathered back to full tensors (for checks and rollout sync)."""
        group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            dim = shard_dim(name)
            if dim is None or tp == 1:
                out[name] = param.detach().clone()
                continue
            parts = [torch.empty_like(param) for _ in range(tp)]
            torch.distributed.all_gather(parts, param.detach().contiguous(), group=group)
            out[name] = torch.cat(parts, dim=dim)
        return out
