"""The residual stream in bf16 (`trainer.bf16_residual`): dropout, residual add and LayerNorm as one function.

Under bf16 autocast the products run in bf16, but LayerNorm and the embeddings output fp32, so the residual
stream between the sublayers is fp32: every Linear re-casts its input, and dropout, the add and LayerNorm
each read and write fp32 tensors. With the switch on, the stream is stored in the autocast dtype; the
functions here compute in fp32 (the sum and LayerNorm's statistics) and round at their output (in eager mode the
dropped-out sublayer output is rounded to bf16 before the sum, as eager bf16 ops round each result). The post-norm
sum is rounded to the stream's dtype before it is normalised, as pre-norm's stream already is: LayerNorm's
backward then recomputes the normalised input from that bf16 sum, where the compiler otherwise saved the
normalised input in fp32, twice the bytes written forward and read back (tests/model/test_residual.py checks what a
compiled layer saves). Under torch.compile each function becomes one kernel that reads bf16 and writes bf16;
in eager mode the same arithmetic runs op by op. The switch changes no weights and no checkpoint key.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def stream_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """bf16 where bf16 autocast is on for `x`'s device, else None (fp32 runs and fp16 keep today's stream:
    fp16's range is too narrow for a residual sum)."""
    on = torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16
    return torch.bfloat16 if on else None


def norm_to(norm: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x) with its statistics in fp32, returned in `dtype`; other modules (nn.Identity) just cast."""
    if isinstance(norm, nn.LayerNorm):
        x = F.layer_norm(x.float(), norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return x.to(dtype)


def dropout_add(x: torch.Tensor, y: torch.Tensor, dropout: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """x + Dropout(y) in `dtype` (the pre-norm residual): the sum computed in fp32 and rounded once. The operands
    are cast to `dtype` rather than the sum from fp32: a graph that casts fp32 to bf16 and back to fp32 (here, for
    the next LayerNorm) has the pair folded away by some releases' inductor (2.11's, not 2.13's), which then stores
    or saves the fp32 tensor instead of the bf16 one (docs/benchmarks/cpu-checks-of-gpu-paths.md, "CPU,
    2026-12-01: torch 2.11")."""
    return x.to(dtype) + dropout(y.to(dtype))


def dropout_add_norm(x: torch.Tensor, y: torch.Tensor, dropout: nn.Module, norm: nn.Module,
                     dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x + Dropout(y)) (the post-norm residual): the sum in fp32 rounded to `dtype` like the stream,
    the statistics in fp32, the result in `dtype`. x, y (B, T, d_model)."""
    return norm_to(norm, dropout_add(x, y, dropout, dtype), dtype)
