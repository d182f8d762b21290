"""trainer.precision=auto on a CPU, chosen by measurement: bf16 autocast only where it is faster than fp32 here.

Hardware bf16 (AMX, AVX512-BF16: speedups.native_bf16_cpu) is necessary but not sufficient: on some CPU kinds
the bf16 step, with its casts and its slower non-matmul kernels, gained nothing over fp32 though its products ran
twice as fast (issue 75; docs/benchmarks/2026-12-02-cpu-bf16.md). So before training, one of the model's own
encoder layers (a copy, in eval mode: no dropout draws, no gradients left on the model) runs forward and backward
at the run's batch size in both precisions, alternately, and the faster one is chosen; the start line says which
and the two times.
"""
import copy
import time
from typing import Optional, Tuple

import torch


def layer_step_ms(layer: torch.nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor],
                  dtype: Optional[torch.dtype]) -> float:
    """Milliseconds of one forward and backward of `layer` on `x` (B, T, d_model), under `dtype` autocast (None:
    fp32)."""
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        bias = None if mask is None else mask.to(dtype or torch.float32)
        out = layer(x, bias)
    out.float().sum().backward()
    return 1e3 * (time.perf_counter() - t0)


def probe(model: torch.nn.Module, tokens: int, rounds: int = 3, length: int = 32) -> Tuple[float, float]:
    """(fp32 ms, bf16 ms): the best of `rounds` forward+backward passes of a copy of `model.encoder[0]` on
    `tokens` rows of random input (`tokens // length` sentences of `length` positions), the two precisions
    alternating so that a busy neighbour slows both alike. The best, not the mean: the neighbours are not ours."""
    layer = copy.deepcopy(model.encoder[0]).eval()
    d_model = model.args.d_model
    g = torch.Generator().manual_seed(0)  # the run's random stream stays untouched
    x = torch.randn(max(tokens // length, 1), length, d_model, generator=g)  # (B, T, d_model)
    mask = torch.zeros(x.size(0), 1, 1, length)  # (B, 1, 1, S): no padding
    best = {None: float("inf"), torch.bfloat16: float("inf")}
    for dtype in best:  # a warm-up pass each: oneDNN's kernel choice, first-touch allocation
        layer_step_ms(layer, x, mask, dtype)
    for _ in range(rounds):
        for dtype in best:
            best[dtype] = min(best[dtype], layer_step_ms(layer, x, mask, dtype))
    return best[None], best[torch.bfloat16]


def choose(model: torch.nn.Module, tokens: int) -> Tuple[Optional[torch.dtype], str]:
    """The autocast dtype for trainer.precision=auto on this CPU (bf16, or None for fp32) and the start line's
    reason. Call only where the CPU has bf16 units (speedups.native_bf16_cpu)."""
    fp32_ms, bf16_ms = probe(model, tokens)
    faster = bf16_ms < fp32_ms
    why = (f"trainer.precision=auto: {'bf16' if faster else 'fp32'} (an encoder layer's forward+backward on "
           f"{tokens} tokens took {bf16_ms:.1f} ms in bf16, {fp32_ms:.1f} ms in fp32 on this CPU)")
    return (torch.bfloat16 if faster else None), why
