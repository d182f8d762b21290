"""The machine's matrix-multiply peak, measured: what `transformer-bench` divides a CPU step's useful FLOP/s by.

A CPU has no datasheet peak the benchmark could look up (its clock, vector units and the oneDNN kernels that
reach them vary by machine), so the limit is what `torch.mm` reaches in the same process, in the compute dtype,
at the model's own product shapes: the feed-forward's (tokens x d_model . d_model x d_ff and back), the
attention's stacked projection (d_model -> 3 d_model) and the output layer (d_model -> vocabulary). A GPU keeps
its datasheet peak (GPU_PEAKS, below).
"""
import re
import time
from typing import Iterable, List, Optional, Tuple

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
    return 2 * m * k * n / best_call_seconds(lambda: torch.mm(a, b), seconds) / 1e12


def best_call_seconds(call, seconds: float) -> float:
    """The fastest of repeated `call()`s over about `seconds`, after one untimed call (at least one timed)."""
    call()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def mm_peak_tflops(shapes: Iterable[Shape], dtype: torch.dtype, seconds: float = 0.25) -> float:
    """The highest of `mm_tflops` over `shapes`: the peak the step's products could reach on this machine."""
    return max(mm_tflops(s, dtype, seconds) for s in shapes)


def cpu_peak_tflops(args, tokens: int, compute: str, seconds: float = 0.25) -> float:
    """The measured peak for a model with `args` (N, d_model, d_ff, tgt_vocab_size) on batches of `tokens`
    rows, in `compute` ("bf16" multiplies bf16 tensors, as autocast does; anything else fp32)."""
    dtype = torch.bfloat16 if compute == "bf16" else torch.float32
    return mm_peak_tflops(model_shapes(tokens, args.d_model, args.d_ff, args.tgt_vocab_size), dtype, seconds)


# Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets, by the name torch.cuda.get_device_name gives;
# the first pattern that matches wins, so specific variants come before their family.
GPU_PEAKS = [
    (r"H100.*PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"H[12]00 NVL", {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    (r"H100|H200", {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),  # SXM (and GH200)
    (r"A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"V100", {"fp16": 125, "fp32": 15.7}),
    (r"L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bT4\b", {"fp16": 65, "fp32": 8.1}),
]


def peak_tflops(device_name: str, compute: str) -> Optional[float]:
    """The table's peak for this GPU and compute type (bf16, fp16, tf32, fp32), or None if unknown."""
    for pattern, peaks in GPU_PEAKS:
        if re.search(pattern, device_name):
            return peaks.get(compute)
    return None
