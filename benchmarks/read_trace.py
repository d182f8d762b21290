"""What a `bench.trace` timeline says about the GPU's idle time: a step whose GPU waits on the host (base at 16k
tokens, Multi30k's batches: docs/benchmarks/the-step.md, "The host") shows it as gaps between kernels. For each gap,
the kernel after it, and the host operator that launched that kernel (the innermost `cpu_op` around its launch
call, matched by the trace's correlation ids); a gap whose next kernel was launched only after the GPU had run
dry is the host's. Prints the window's busy and idle time, the idle time by launching operator, and the longest
gaps. With `--kernels N`, the N kernels that took the most GPU time, by name (ms per step with `--steps`, calls,
µs a call). With `--code`, the Triton source of a compiled kernel from the code torch.compile logged
(TORCH_LOGS=output_code, which `make bench-gpu` keeps beside the trace). Reads the files a lease brings back;
needs no GPU. Prints measured numbers, asserts nothing.

    python benchmarks/read_trace.py TRACE.json[.gz] [--gaps 15] [--min-gap-us 2]
    python benchmarks/read_trace.py TRACE.json[.gz] --kernels 40 --steps 5   # bench.trace profiles 5 steps
    python benchmarks/read_trace.py --code CODE.txt --kernel triton_per_fused_..._6
"""
import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto's categories of work on the GPU's timeline
LAUNCH = ("cuda_runtime", "cuda_driver")  # the host's calls that queue it (launches, graph launches, copies)
HOST_OPS = ("cpu_op", "user_annotation")  # operators and record_function ranges around the launches


def load(path: Path) -> List[dict]:
    """The trace's complete ('X') events."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X" and "ts" in e]


def launches(events: List[dict]) -> Dict[int, Tuple[str, float]]:
    """correlation id -> (the innermost host operator open on the launch call's thread, the call's start)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_OPS + LAUNCH:
            by_thread[e.get("tid")].append(e)
    found = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # an enclosing op first at equal starts
        stack: List[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < e["ts"]:
                stack.pop()
            if e["cat"] in LAUNCH:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    found[corr] = (stack[-1]["name"] if stack else "(no operator)", e["ts"])
            else:
                stack.append(e)
    return found


def gaps(events: List[dict], min_gap_us: float = 2.0) -> dict:
    """The device's busy and idle time over the window of its work, and every idle gap of at least `min_gap_us`:
    {window_us, busy_us, idle_us, host_idle_us, gaps: [{us, kernel, op, host}]}, where `host` says the kernel after
    the gap was launched only once the GPU had nothing left to run (the host held it back)."""
    device = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    if not device:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "host_idle_us": 0.0, "gaps": []}
    launched = launches(events)
    idle, found, end = 0.0, [], device[0]["ts"]
    start = end
    for e in device:
        if e["ts"] > end:  # the device ran dry at `end`
            idle += e["ts"] - end
            if e["ts"] - end >= min_gap_us:
                op, at = launched.get((e.get("args") or {}).get("correlation"), ("(unmatched)", float("-inf")))
                found.append({"us": e["ts"] - end, "kernel": e["name"], "op": op, "host": at >= end})
        end = max(end, e["ts"] + e.get("dur", 0))
    window = end - start
    return {"window_us": window, "busy_us": window - idle, "idle_us": idle,
            "host_idle_us": sum(g["us"] for g in found if g["host"]), "gaps": found}


def report(result: dict, top: int = 15) -> str:
    if not result["window_us"]:
        return "no GPU activity in this trace (a CPU run's trace holds host operators only)"
    w = result["window_us"]
    lines = [f"device window {w / 1e3:.2f} ms: busy {result['busy_us'] / 1e3:.2f} ms "
             f"({100 * result['busy_us'] / w:.1f}%), idle {result['idle_us'] / 1e3:.2f} ms, of which "
             f"{result['host_idle_us'] / 1e3:.2f} ms waiting for a launch ({len(result['gaps'])} gaps counted)"]
    by_op = collections.Counter()
    for g in result["gaps"]:
        by_op[g["op"]] += g["us"]
    lines += ["", "idle time before the kernels each host operator launched:"]
    lines += [f"  {us / 1e3:9.3f} ms  {100 * us / w:5.1f}%  {op[:100]}" for op, us in by_op.most_common(top)]
    lines += ["", f"the {top} longest gaps (us, launched late by the host?, next kernel, its operator):"]
    for g in sorted(result["gaps"], key=lambda g: -g["us"])[:top]:
        lines.append(f"  {g['us']:9.1f}  {'host' if g['host'] else 'queue':5s}  {g['kernel'][:70]}  <- {g['op'][:40]}")
    return "\n".join(lines)


def kernel_table(events: List[dict], steps: int = 1, top: int = 40) -> str:
    """The `top` kernels (and copies) by their summed time: ms and calls per step, µs a call, share of the total."""
    time, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") in DEVICE:
            time[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    total = sum(time.values()) or 1.0
    lines = [f"kernel time: {total / 1e3 / steps:.3f} ms a step over {steps} step(s); the {top} largest:",
             "   ms/step  share  calls/step   us/call  name"]
    for name, us in time.most_common(top):
        lines.append(f"  {us / 1e3 / steps:8.3f} {100 * us / total:5.1f}% {calls[name] / steps:10.1f} "
                     f"{us / calls[name]:9.1f}  {name[:110]}")
    return "\n".join(lines)


_PREFIX = re.compile(r"^[VIWE]\d{4} [\d:.]+ \d+ \S+\] (\[[^\]]*\] )*")  # torch's log prefix on each line


def kernel_source(code: str, name: str) -> Optional[str]:
    """The source of compiled kernel `name` (Triton on GPUs, C++ on CPUs) in torch.compile's logged output code,
    with the comment lines above it (which ATen operators it fuses), or None."""
    text = "\n".join(_PREFIX.sub("", line) for line in code.splitlines())
    match = re.search(rf"((?:^#[^\n]*\n)*)^{re.escape(name)} = async_compile\.\w+\([^\n]*?r?'''\n(.*?)\n'''", text,
                      re.S | re.M)
    return match.group(1) + match.group(2) if match else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", type=Path, help="a bench.trace file (.json or .json.gz)")
    p.add_argument("--gaps", type=int, default=15, help="how many operators and gaps to list")
    p.add_argument("--min-gap-us", type=float, default=2.0, help="shorter idle spans are not counted as gaps")
    p.add_argument("--kernels", type=int, help="list this many kernels by their summed time")
    p.add_argument("--steps", type=int, default=1, help="with --kernels: the steps the trace holds (per-step figures)")
    p.add_argument("--code", type=Path, help="torch.compile's logged output code (TORCH_LOGS=output_code; .gz too)")
    p.add_argument("--kernel", help="with --code: the compiled kernel whose source to print")
    args = p.parse_args(argv)
    if args.code:
        if not args.kernel:
            p.error("--code needs --kernel NAME")
        raw = args.code.read_bytes()
        source = kernel_source((gzip.decompress(raw) if args.code.suffix == ".gz" else raw).decode(errors="replace"),
                               args.kernel)
        if source is None:
            print(f"error: no kernel named {args.kernel} in {args.code}", file=sys.stderr)
            return 2
        print(source)
    if args.trace:
        events = load(args.trace)
        print(report(gaps(events, args.min_gap_us), args.gaps))
        if args.kernels:
            print("\n" + kernel_table(events, max(args.steps, 1), args.kernels))
    elif not args.code:
        p.error("give a trace, or --code and --kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
