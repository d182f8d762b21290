"""`transformer-bench`'s profile window: a few more training steps under torch.profiler, reduced to the device's
busy fraction (the time some kernel or copy ran, over the window's wall time on the device) and the top
operators by self time: kernels by self device time on a GPU, operators by self CPU time on a CPU (where
there is no device timeline, so no busy fraction either)."""
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch


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
             and getattr(a, key, 0) > 0]
    if device and not items:  # kernels not told apart by this torch: operators with the kernel time they launched
        items = [a for a in averages if getattr(a, key, 0) > 0]
    total = sum(getattr(a, key) for a in items) or 1.0
    items.sort(key=lambda a: getattr(a, key), reverse=True)
    return [{"name": a.key, "calls": a.count // max(steps, 1), "self_ms": getattr(a, key) / 1e3 / max(steps, 1),
             "share": getattr(a, key) / total} for a in items[:rows]]


def profile_window(run: Callable[[int], None], sync: Callable[[], None], device: torch.device, steps: int,
                   rows: int) -> Dict:
    """Runs `run(steps)` under torch.profiler. Returns {steps, wall_ms (per step, profiler overhead included),
    busy (device busy fraction, None on CPU), top: top_operators, table: torch's own table}."""
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
    if cuda:
        events = prof.events()
        spans = [(e.time_range.start, e.time_range.end) for e in events if str(e.device_type).endswith("CUDA")]
        # The window: from the first event on either side to the last (host and device clocks are aligned).
        window = (min(e.time_range.start for e in events), max(e.time_range.end for e in events))
        busy = busy_fraction(spans, window)
    averages = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return {"steps": steps, "wall_ms": 1e3 * wall / steps, "busy": busy, "host_syncs": len(syncs) if cuda else None,
            "top": top_operators(averages, cuda, rows, steps),
            "table": averages.table(sort_by=key, row_limit=rows)}


def top_table(top: List[Dict], device: bool) -> str:
    """The top operators as aligned text: self time per step, its share, calls per step, name."""
    head = f"top {len(top)} {'kernels by self device time' if device else 'operators by self CPU time'} (per step)"
    lines = [head] + [f"  {t['self_ms']:9.3f} ms  {100 * t['share']:5.1f}%  x{t['calls']:<5d} {t['name'][:90]}"
                      for t in top]
    return "\n".join(lines)
