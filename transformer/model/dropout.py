"""Dropout (paper Section 5.4, P_drop) that costs little on CPUs.

On a CPU, `nn.Dropout` draws one Bernoulli sample per element, and that costs as much as the matrix product
before it (torch.profiler, `aten::bernoulli_`; docs/benchmarks/switches.md). Here one 64-bit random integer gives four
16-bit ones, and an element is kept when its 16 bits pass a threshold: cheaper per call, the same
expectation. P_drop is rounded to a multiple of 1/65536 (0.1 becomes 0.1000061), and survivors are scaled
by the exact inverse of the rounded keep rate, so E[out] = x still holds.
Other devices, and compiled graphs (whose generated code draws its own random numbers and would otherwise
break at the int16 view), keep torch's own dropout.
"""
import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16  # values of a 16-bit lane


def keep_mask(shape: torch.Size, p: float, dtype: torch.dtype, scaled: bool = True) -> torch.Tensor:
    """A (shape) tensor of 0 and 1 / (1 - p') (of 0 and 1 when not `scaled`), where p' = round(p * 65536) / 65536
    is the drop rate used.

    The draw spans the full int64 range: `random_()` alone stops at 2**63 - 1, which would leave every
    fourth 16-bit lane non-negative and so keep too many elements there."""
    n = shape.numel()
    dropped = round(p * _LEVELS)
    lanes = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None).view(torch.int16)
    keep = lanes[:n].view(shape) >= dropped - (_LEVELS // 2)  # int16 runs from -32768: `dropped` values fail
    return keep.to(dtype).mul_(keep_scale(p)) if scaled else keep.to(dtype)


def keep_scale(p: float) -> float:
    """1 / (1 - p'), the survivors' scale."""
    return _LEVELS / (_LEVELS - round(p * _LEVELS))


def uses_keep_mask(x: torch.Tensor) -> bool:
    """Whether dropout on `x` draws `keep_mask` (eager CPU tensors) rather than torch's own dropout."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def check_rate(p: float) -> float:
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return p


class Dropout(nn.Module):
    """Drop-in for `nn.Dropout(p)` (no parameters, so checkpoints are unchanged): identity in eval mode."""

    def __init__(self, p: float):
        super().__init__()
        self.p = check_rate(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if not uses_keep_mask(x):
            return F.dropout(x, self.p, training=True)
        if x.dtype in (torch.float32, torch.float64):
            return x * keep_mask(x.shape, self.p, x.dtype)
        # bf16 and fp16 cannot hold the scale (P_drop 0.1: 1.109375 in bf16, every survivor 0.16 % too small): the
        # mask's 0s and 1s first, then the scale as a Python float, so each survivor is x times it rounded once
        return (x * keep_mask(x.shape, self.p, x.dtype, scaled=False)).mul_(keep_scale(self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"
