"""The tiny language model in plain PyTorch, unsharded, for the controller's cross-check.

Nothing here imports megatron-core, so the controller can build the reference without paying the
megatron import.  The parallel model (:mod:`rankmesh.megatron.model`) loads its shards from the
very same full weights (:func:`full_weights`), which is what makes "3D-parallel log-probs equal the
single-process log-probs" a meaningful check: any mistake in sharding, pipeline hand-off or rank
mapping shows up as a numeric difference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the tiny causal LM (defaults fit a 2-core CPU box running the demo's 16 processes)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    ffn_hidden_size: int = 64
    max_seq_len: int = 32
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Which weights are column-sharded (dim 0), row-sharded (dim 1) or replicated under tensor
# parallelism; the parallel model slices the full tensors accordingly.
COLUMN_SHARDED = ("embed.weight", "q.weight", "q.bias", "k.weight", "v.weight", "v.bias",
                  "fc1.weight", "fc1.bias", "head.weight")
ROW_SHARDED = ("proj.weight", "fc2.weight")


def shard_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits weight ``name`` (None: replicated)."""
    leaf = ".".join(name.split(".")[-2:])
    if leaf in COLUMN_SHARDED:
        return 0
    if leaf in ROW_SHARDED:
        return 1
    return None


def full_weights(cfg: TinyConfig, seed: int | None = None, value_head: bool = False) -> dict[str, torch.Tensor]:
    """Every full (unsharded) weight of the model, drawn from one seeded generator in a fixed order.

    Initializing the full tensor and slicing it is what keeps the model identical whatever the
    tensor-parallel size: each rank's shard is a slice of the same numbers.
    """
    gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    out_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    w: dict[str, torch.Tensor] = {"embed.weight": normal(v, h, std=0.5)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "ln1.weight"], w[p + "ln1.bias"] = torch.ones(h), torch.zeros(h)
        w[p + "q.weight"], w[p + "q.bias"] = normal(h, h, std=0.2), normal(h, std=0.02)
        w[p + "k.weight"] = normal(h, h, std=0.2)  # no key bias: softmax cancels it (zero gradient)
        w[p + "v.weight"], w[p + "v.bias"] = normal(h, h, std=0.2), normal(h, std=0.02)
        w[p + "proj.weight"], w[p + "proj.bias"] = normal(h, h, std=out_std * 10), torch.zeros(h)
        w[p + "ln2.weight"], w[p + "ln2.bias"] = torch.ones(h), torch.zeros(h)
        w[p + "fc1.weight"], w[p + "fc1.bias"] = normal(f, h, std=0.2), normal(f, std=0.02)
        w[p + "fc2.weight"], w[p + "fc2.bias"] = normal(h, f, std=out_std * 10), torch.zeros(h)
    w["final_ln.weight"], w["final_ln.bias"] = torch.ones(h), torch.zeros(h)
    if value_head:
        w["value.weight"], w["value.bias"] = normal(1, h, std=0.02), torch.zeros(1)
    else:
        w["head.weight"] = normal(v, h, std=0.3)
    return w


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal self-attention over [batch, seq, heads*head_dim] tensors (any number of heads).

    Shared by the reference and the tensor-parallel model (which passes only its local heads), so
    both compute exactly the same per-head arithmetic.
    """
    b, s, width = q.shape
    heads = width // head_dim
    q, k, v = (t.view(b, s, heads, head_dim).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = scores.softmax(dim=-1) @ v
    return out.transpose(1, 2).reshape(b, s, width)


class _RefLayer(torch.nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.cfg = cfg
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.q, self.k, self.v = torch.nn.Linear(h, h), torch.nn.Linear(h, h, bias=False), torch.nn.Linear(h, h)
        self.proj = torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.proj(causal_attention(self.q(y), self.k(y), self.v(y), self.cfg.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ReferenceModel(torch.nn.Module):
    """The whole model in one process: embedding, layers, final norm, LM head (or value head)."""

    def __init__(self, cfg: TinyConfig, value_head: bool = False, seed: int | None = None) -> None:
        super().__init__()
        self.cfg, self.value_head = cfg, value_head
        h = cfg.hidden_size
        self.embed = torch.nn.Embedding(cfg.vocab_size, h)
        self.layers = torch.nn.ModuleList(_RefLayer(cfg) for _ in range(cfg.num_layers))
        self.final_ln = torch.nn.LayerNorm(h)
        if value_head:
            self.value = torch.nn.Linear(h, 1)
        else:
            self.head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
        self.load_state_dict(full_weights(cfg, seed, value_head=value_head))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.final_ln(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab], or values [b, s] for a value-head model."""
        x = self.hidden(tokens)
        return self.value(x).squeeze(-1) if self.value_head else self.head(x)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t: shape [b, s-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample(model: ReferenceModel, prompts: torch.Tensor, length: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``length`` tokens after each prompt; row i draws from a generator seeded ``seeds[i]``.

    Returns (sequences [b, p+length], log-probs of the sampled tokens [b, length]).  One generator
    per row makes a row's sample independent of how the batch was split across ranks.
    """
    seqs, logps = [], []
    for row, seed in zip(prompts, seeds):
        gen = torch.Generator().manual_seed(int(seed))
        seq, lp = row.clone().unsqueeze(0), []
        for _ in range(length):
            logp = torch.log_softmax(model(seq)[0, -1].float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            lp.append(logp[tok])
            seq = torch.cat([seq, tok.view(1, 1)], dim=1)
        seqs.append(seq[0])
        logps.append(torch.cat(lp))
    return torch.stack(seqs), torch.stack(logps)
