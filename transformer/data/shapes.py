"""Static batch shapes (trainer.static_shapes): every training micro-batch padded to one of a few fixed (rows, source
length, target length) shapes, so torch.compile and CUDA graphs see a handful of shapes instead of one per batch.

Lengths come from a ladder of `steps` lengths an octave (trainer.shape_steps): with the default 4, multiples of 4 up
to 32, then 40, 48, 56, 64, 80, 96, 112, 128, 160, ..., so a length is padded by at most 3 positions up to 32 and by
less than a quarter of itself above; 8 steps halve that padding (multiples of 2 up to 32, then 36, 40, ..., 64, 72,
..., less than an eighth above) for about twice the shapes, 16 steps pad nothing up to 32. A coarser ladder (8, 16,
24, 32, 48, 64, 96, ...) gave half the shapes but twice the padding (docs/benchmarks/switches.md); lengths need not be
multiples of 8, since the matrix products' inner sizes are d_model and d_ff, and the attention kernels pad
internally. The sampler packs a batch by its examples' ladder lengths (`shape_length(max(source, target))`), so a
batch of length L holds at most `rows(L, budget)` = budget // L sentences, and padded to that many rows it still
costs at most the token budget: the memory the user sized data.max_tokens for. Rows added to reach the fixed row
count are dummy pairs that carry no loss: source `</s>` alone (one real key, so no attention row is all masked and
softmax never sees a row of -inf), target all <pad> (no loss, hence no gradient).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from transformer.data.config import SHAPE_STEPS
from transformer.specials import EOS, PAD

FINE = 32  # up to here, multiples of FINE / (2 * steps): the step of the octave 16-32
STEPS = 4  # trainer.shape_steps' default


def shape_length(n: int, steps: int = STEPS) -> int:
    """The smallest ladder length >= n with `steps` lengths an octave: multiples of 32 / (2 * steps) up to 32,
    then multiples of the power of two >= n over 2 * steps (steps=4: 4, 8, ..., 32, 40, 48, 56, 64, 80, ...)."""
    if steps not in SHAPE_STEPS:
        raise ValueError(f"trainer.shape_steps={steps}: must be one of {', '.join(map(str, SHAPE_STEPS))}")
    if n <= FINE:
        q = FINE // (2 * steps)
        return max(q, -(-int(n) // q) * q)
    step = (1 << (int(n) - 1).bit_length()) // (2 * steps)  # the power of two >= n, over 2 * steps
    return -(-int(n) // step) * step


def rows(length: int, budget: int, max_sentences: Optional[int] = None) -> int:
    """Sentences a batch of ladder length `length` may hold within `budget` tokens (at least one)."""
    n = max(budget // length, 1)
    return min(n, max_sentences) if max_sentences else n


def static_shape(src_len: int, tgt_len: int, budget: int, max_sentences: Optional[int] = None,
                 steps: int = STEPS) -> Tuple[int, int, int]:
    """(rows, S, T) of a batch whose padded source and target lengths are `src_len`, `tgt_len`: each length
    up to its ladder length, the rows from the longer side's (the sampler packed the batch by it)."""
    S, T = shape_length(src_len, steps), shape_length(tgt_len, steps)
    return rows(max(S, T), budget, max_sentences), S, T


def pad_to_shape(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, shape: Tuple[int, int, int]):
    """(B, S0), (B, T0), (B, T0) -> (rows, S), (rows, T), (rows, T): lengths right-padded with <pad>, then dummy
    rows appended (source `</s>` then <pad>, targets all <pad>). Works on any device; no host sync."""
    R, S, T = shape
    B = src.size(0)
    if B > R or src.size(1) > S or tgt_in.size(1) > T:
        raise ValueError(f"a batch of shape {(B, src.size(1), tgt_in.size(1))} does not fit static shape {shape}")
    src = F.pad(src, (0, S - src.size(1), 0, R - B), value=PAD)
    tgt_in = F.pad(tgt_in, (0, T - tgt_in.size(1), 0, R - B), value=PAD)
    tgt_out = F.pad(tgt_out, (0, T - tgt_out.size(1), 0, R - B), value=PAD)
    if R > B:
        src[B:, 0] = EOS
    return src, tgt_in, tgt_out
