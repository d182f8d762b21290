"""The machine's matrix-multiply peak, measured: what `transformer-bench` divides a CPU step's useful FLOP/s by.

A CPU has no datasheet peak the benchmark could look up (its clock, vector units and the oneDNN kernels that
reach them vary by machine), so the limit is what `torch.mm` reaches in the same process, in the compute dtype,
at the model's own product shapes: the feed-forward's (tokens x d_model . d_model x d_ff and back), the
attention's stacked projection (d_model -> 3 d_model) and the output layer (d_model -> vocabulary). A GPU keeps
its datasheet peak (transformer/training/bench.py, GPU_PEAKS).
"""
import time
from typing import Iterable, List, Tuple

import torch

Shape = Tuple[int, int, int]  # (m, k, n): an (m, k) . (k, n) product


def model_shapes(tokens: int, d_model: int, d_ff: int, vocab: int) -> List[Shape]:
    """The training step's large products for a batch of `tokens` rows (B x T flattened)."""
    return [(tokens, d_model, d_ff), (tokens, d_ff, d_model), (tokens, d_model, 3 * d_model),
            (tokens, d_model, vocab)]


def mm_tflops(shape: Shape, dtype: torch.dtype, seconds: float = 0.25, device: str = "cpu") -> float:
    """The best TFLOP/s of `torch.mm` at `shape` in `dtype` over `seconds` of repeated calls (one warm-up call
    first: oneDNN's kernel choice and the first touch of the memory). The best call, not the mean: on a shared
    machine the mean measures the neighbours too, and a peak is what the hardware can do."""
    m, k, n = shape
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 2 * m * k * n / best / 1e12


def mm_peak_tflops(shapes: Iterable[Shape], dtype: torch.dtype, seconds: float = 0.25) -> float:
    """The highest of `mm_tflops` over `shapes`: the peak the step's products could reach on this machine."""
    return max(mm_tflops(s, dtype, seconds) for s in shapes)


def cpu_peak_tflops(args, tokens: int, compute: str, seconds: float = 0.25) -> float:
    """The measured peak for a model with `args` (N, d_model, d_ff, tgt_vocab_size) on batches of `tokens`
    rows, in `compute` ("bf16" multiplies bf16 tensors, as autocast does; anything else fp32)."""
    dtype = torch.bfloat16 if compute == "bf16" else torch.float32
    return mm_peak_tflops(model_shapes(tokens, args.d_model, args.d_ff, args.tgt_vocab_size), dtype, seconds)
