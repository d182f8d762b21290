"""`transformer-bench`'s profile window: a few more training steps under torch.profiler, reduced to the device's
busy fraction (the time some kernel or copy ran, over the window's wall time on the device), the top
operators by self time: kernels by self device time on a GPU, operators by self CPU time on a CPU (where
there is no device timeline, so no busy fraction either), and the step's whole kernel account: kernels,
their time by family and the host's launch calls per step on a GPU, operators per step on a CPU. The top list
names the 15 largest kernels; the families account for all of them, so a profile says where every
millisecond of device time went, and the launches what the host pays for them. `bench.trace` keeps the
window's whole timeline too (`write_trace`): each kernel and host call in order, for Perfetto."""
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from transformer import dist
from transformer.atomic import atomic_open


def busy_fraction(intervals: Iterable[Tuple[float, float]], window: Optional[Tuple[float, float]] = None
                  ) -> Optional[float]:
    """The length of the union of `intervals` (start, end) over `window` (default: first start to last end).
    Kernels on several streams overlap: counted once. None when there is nothing to measure."""
    spans = sorted((a, b) for a, b in intervals if b > a)
    if not spans:
        return None
    lo, hi = window if window is not None else (spans[0][0], max(b for _, b in spans))
    if hi <= lo:
        return None
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    return busy / (hi - lo)


# Kernel families by name, the first that matches: compiled (Triton) kernels are named after what they fuse,
# so the loss's and attention's are told apart before the generic "compiled" family takes the rest.
FAMILIES = (
    # SDPA's softmax is inside its kernels; the compiled loss's passes (loss.py) fuse a gather after the rows'
    # maxima (forward) and compare each column with the target (backward)
    ("loss", r"log_?softmax|softmax|cross_entropy|nll_loss|amax.*gather|arange.*_eq_exp"),
    ("attention", r"fmha|flash|attention|sdpa"),
    ("matmul", r"gemm|nvjet|xmma|cublas|cutlass|splitk|_mm_|matmul"),
    ("compiled (Triton)", r"^triton_"),
    ("optimizer", r"fusedoptim|multi_tensor_apply|adam"),
    ("layer norm", r"layer_norm|gammabeta|layernorm"),
    ("dropout", r"dropout|bernoulli"),
    ("copy, cast, cat", r"copy|catarray|memcpy|memset|_to_copy|cast"),
    ("reduction", r"reduce_kernel|norm_kernel|sum_kernel"),
    ("elementwise", r"elementwise"),
)
# The host's calls that put work on the GPU's queue, runtime and driver API (cudaLaunchKernel, cuLaunchKernelEx,
# cudaGraphLaunch, cudaMemcpyAsync, ...): what a host-bound step spends its time on.
LAUNCH = re.compile(r"^cu(da)?(Launch|GraphLaunch|Memcpy|Memset)")


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((family for family, pattern in FAMILIES if re.search(pattern, low)), "other")


def device_events(events) -> list:
    """The profile's device activity (kernels, copies, memsets), without user annotations: an annotation
    (`Optimizer.step#Adam.step`) spans the kernels of its range, gaps included, on the device's timeline."""
    return [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
            and not getattr(e, "is_user_annotation", False)]


def kernel_account(events, steps: int, cuda: bool) -> Dict:
    """Per step: on a GPU {kernels, kernel_ms (summed, overlaps counted twice), launches (host calls that
    queue device work), families {name: ms}}; on a CPU {ops: operator calls, nested ones included}."""
    steps = max(steps, 1)
    if not cuda:
        return {"ops": sum(1 for e in events if e.name.startswith("aten::")) / steps}
    kernels = device_events(events)
    families: Dict[str, float] = {}
    for e in kernels:
        family = kernel_family(e.name)
        families[family] = families.get(family, 0.0) + (e.time_range.end - e.time_range.start) / 1e3 / steps
    return {"kernels": len(kernels) / steps, "kernel_ms": sum(families.values()),
            "launches": sum(1 for e in events if LAUNCH.match(e.name)) / steps,
            "families": dict(sorted(families.items(), key=lambda kv: -kv[1]))}


def host_syncs(fn: Callable[[], None]) -> List[str]:
    """Messages of the synchronising CUDA calls `fn` makes (torch.cuda.set_sync_debug_mode: GPU only; CUDA event
    waits are not among them, LaggedFlag counts its own)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch >= 2.11 also warns, once per process, that the debug mode itself is a prototype: not a sync.
    return [str(w.message) for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]


def top_operators(averages, device: bool, rows: int, steps: int) -> List[Dict]:
    """[{name, calls, self_ms (per step), share}] of the `rows` operators (kernels when `device`) with the most
    self time; `share` is the fraction of all self time of that kind in the window."""
    key = "self_device_time_total" if device else "self_cpu_time_total"
    kind = "CUDA" if device else "CPU"
    items = [a for a in averages if (str(getattr(a, "device_type", "")).endswith(kind) or not device)
             and getattr(a, key, 0) > 0 and not (device and getattr(a, "is_user_annotation", False))]
    if device and not items:  # kernels not told apart by this torch: operators with the kernel time they launched
        items = [a for a in averages if getattr(a, key, 0) > 0]
    total = sum(getattr(a, key) for a in items) or 1.0
    items.sort(key=lambda a: getattr(a, key), reverse=True)
    return [{"name": a.key, "calls": a.count // max(steps, 1), "self_ms": getattr(a, key) / 1e3 / max(steps, 1),
             "share": getattr(a, key) / total} for a in items[:rows]]


def profile_window(run: Callable[[int], None], sync: Callable[[], None], device: torch.device, steps: int,
                   rows: int, trace: Optional[str] = None) -> Dict:
    """Runs `run(steps)` under torch.profiler. Returns {steps, wall_ms (per step, profiler overhead included),
    busy (device busy fraction, None on CPU), top: top_operators, account: kernel_account, table: torch's own
    table}; with `trace`, also writes the window's timeline there (write_trace)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    syncs = []
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        if cuda:
            syncs = host_syncs(lambda: run(steps))
        else:
            run(steps)
        sync()
        wall = time.perf_counter() - t0
    busy = None
    events = prof.events()
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in device_events(events)]
        # The window: from the first event on either side to the last (host and device clocks are aligned).
        window = (min(e.time_range.start for e in events), max(e.time_range.end for e in events))
        busy = busy_fraction(spans, window)
    if trace:
        write_trace(prof, trace)
    averages = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return {"steps": steps, "wall_ms": 1e3 * wall / steps, "busy": busy, "host_syncs": len(syncs) if cuda else None,
            "top": top_operators(averages, cuda, rows, steps), "account": kernel_account(events, steps, cuda),
            "table": averages.table(sort_by=key, row_limit=rows)}


@dist.rank_zero
def write_trace(prof, path) -> None:
    """The profile's timeline as Chrome trace JSON (Perfetto, chrome://tracing) at `path`, gzipped when it ends
    in .gz: written whole or not at all. torch.profiler writes in place; its file goes through a temporary one."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / ("trace.json.gz" if path.suffix == ".gz" else "trace.json")
        prof.export_chrome_trace(str(raw))
        with atomic_open(path, "wb") as out, open(raw, "rb") as src:
            shutil.copyfileobj(src, out)


def top_table(top: List[Dict], device: bool) -> str:
    """The top operators as aligned text: self time per step, its share, calls per step, name."""
    head = f"top {len(top)} {'kernels by self device time' if device else 'operators by self CPU time'} (per step)"
    lines = [head] + [f"  {t['self_ms']:9.3f} ms  {100 * t['share']:5.1f}%  x{t['calls']:<5d} {t['name'][:90]}"
                      for t in top]
    return "\n".join(lines)
