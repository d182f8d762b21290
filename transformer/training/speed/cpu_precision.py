"""trainer.precision=auto on a CPU, chosen by measurement: bf16 autocast only where it is faster than fp32 here.

Hardware bf16 (AMX, AVX512-BF16: speedups.native_bf16_cpu) is necessary but not sufficient: on some CPU kinds
the bf16 step, with its casts and its slower non-matmul kernels, gained nothing over fp32 though its products ran
twice as fast (issue 75; docs/benchmarks/2026-12-02-cpu-bf16.md). So before training, one of the model's own
encoder layers (a copy, in eval mode: no dropout draws, no gradients left on the model) runs forward and backward
at the run's batch size in both precisions, alternately, and the faster one is chosen; the start line says which
and the two times.
"""
import copy
import json
import platform
import time
from pathlib import Path
from typing import Optional, Tuple

import torch

from transformer.atomic import write_text_atomic
from transformer.data.download import default_root


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


# bf16 only where it is clearly faster: its rounding is not worth a few percent, and a close race would let the
# load of the moment decide (two runs of one command training in different precisions).
BF16_MARGIN = 1.2


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which keys the remembered probe results."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def choose(model: torch.nn.Module, tokens: int, cache: Optional[Path] = None) -> Tuple[Optional[torch.dtype], str]:
    """The autocast dtype for trainer.precision=auto on this CPU (bf16, or None for fp32) and the start line's
    reason. Call only where the CPU has bf16 units (speedups.native_bf16_cpu).

    The answer is remembered in `cache` (default: the user's cache folder, cpu_precision.json), by CPU model,
    torch version, layer shape and batch size: where the two precisions are close, a probe's answer can flip
    between runs with the machine's load, and a rerun of the same seeded command (or a comparison of an
    interrupted run with an uninterrupted one) must train in the same precision."""
    args = model.args
    key = (f"{cpu_name()} | torch {torch.__version__} | d_model {args.d_model} d_ff {args.d_ff} h {args.h} | "
           f"{tokens} tokens")
    path = cache if cache is not None else default_root() / "cpu_precision.json"
    known = _read(path)
    if key in known:
        fp32_ms, bf16_ms = known[key]
        when = f"measured earlier on this CPU, remembered in {path}"
    else:
        fp32_ms, bf16_ms = probe(model, tokens)
        when = "on this CPU"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps({**known, key: [fp32_ms, bf16_ms]}, indent=1) + "\n")
        except OSError:  # an unwritable cache only costs the next run a probe
            pass
    faster = bf16_ms * BF16_MARGIN < fp32_ms
    why = (f"trainer.precision=auto: {'bf16' if faster else 'fp32'} (an encoder layer's forward+backward on "
           f"{tokens} tokens took {bf16_ms:.1f} ms in bf16, {fp32_ms:.1f} ms in fp32, {when})")
    return (torch.bfloat16 if faster else None), why


def _read(path: Path) -> dict:
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: probe again
        return {}
    return known if isinstance(known, dict) else {}
