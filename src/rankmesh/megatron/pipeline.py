"""A CPU pipeline schedule: stages exchange activations and gradients with send/recv over the pp group.

megatron-core's own schedules (``get_forward_backward_func``) hard-code CUDA streams and events, so
on CPU we run the simplest correct schedule ourselves: GPipe (all micro-batch forwards, then all
backwards in reverse).  Each rank talks only to its neighbours in its pipeline group, which
``parallel_state`` built from the mesh; on CUDA, use megatron's interleaved 1F1B schedules instead
(see docs/megatron.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


@dataclass
class PipelineResult:
    """What the last stage produced for each micro-batch (empty lists on other stages)."""

    outputs: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def _neighbours() -> tuple[int | None, int | None]:
    """Global ranks of the previous and next stage (None at the ends of the pipeline)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None, None
    prev = None if ps.is_pipeline_first_stage() else ps.get_pipeline_model_parallel_prev_rank()
    nxt = None if ps.is_pipeline_last_stage() else ps.get_pipeline_model_parallel_next_rank()
    return prev, nxt


def _recv(shape: Sequence[int], src: int) -> torch.Tensor:
    buf = torch.empty(*shape, dtype=torch.float32)
    dist.recv(buf, src=src, group=ps.get_pipeline_model_parallel_group())
    return buf


def _send(tensor: torch.Tensor, dst: int) -> None:
    dist.send(tensor.detach().contiguous(), dst=dst, group=ps.get_pipeline_model_parallel_group())


def run_pipeline(
    stage: torch.nn.Module,
    microbatches: Sequence[dict[str, torch.Tensor]],
    last_stage_fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], Any],
    hidden_size: int,
    forward_only: bool,
) -> PipelineResult:
    """Run ``microbatches`` through this rank's ``stage`` (GPipe schedule).

    Every micro-batch holds ``input_ids`` [b, s]; the first stage embeds them, later stages receive
    the [b, s, hidden] activations from the previous stage.  On the last stage ``last_stage_fn``
    turns the stage output into either an output (``forward_only``) or a scalar loss, already
    scaled for accumulation over micro-batches; its gradient flows back stage by stage.
    """
    prev, nxt = _neighbours()
    result = PipelineResult()
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    with torch.set_grad_enabled(not forward_only):
        for mb in microbatches:
            b, s = mb["input_ids"].shape
            if prev is None:
                inp = None
                out = stage(mb["input_ids"])
            else:
                inp = _recv((b, s, hidden_size), prev).requires_grad_(not forward_only)
                out = stage(inp)
            if nxt is not None:
                _send(out, nxt)
                saved.append((inp, out))
                continue
            value = last_stage_fn(out, mb)
            if forward_only:
                result.outputs.append(value)
            else:
                loss, extra = value if isinstance(value, tuple) else (value, None)
                result.losses.append(loss)
                result.outputs.append(extra)
                saved.append((inp, loss))
    if forward_only:
        return result
    for inp, out in reversed(saved):
        if nxt is None:
            out.backward()
        else:
            grad = _recv(out.shape, nxt)
            torch.autograd.backward(out, grad)
        if prev is not None:
            _send(inp.grad, prev)
    return result
