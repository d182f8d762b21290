"""The Markdown summary of a `make bench-gpu` call (benchmarks/bench_gpu.py): one row per run, the loss
benchmark's lines, the top kernels of the profiled eager runs, the files kept beside the records and every
kernel's time by family. The rows go into docs/benchmarks/ as they are."""
from pathlib import Path


def _memory(r: dict) -> str:
    """The timed steps' peak allocation, and what the allocator held (CUDA graphs' pools too) where recorded."""
    reserved = r.get("reserved_gb")
    return f"{r['peak_mem_gb']:.1f}" + (f" ({reserved:.1f})" if reserved is not None else "")


def _pct(v) -> str:
    return f"{100 * v:.1f}%" if v is not None else "n/a"


def markdown(header: dict, records: list, skipped: list, top_of=("big@16k", "base@16k"),
             loss_text: str = "") -> str:
    """The summary for the performance document: one row per run, the loss benchmark's lines, then the top
    kernels of the eager runs named in `top_of` (or of the first profiled run)."""
    lines = [f"**{header['device']}**, {header['date']}, torch {header['torch']} (CUDA {header['cuda']}), commit "
             f"{header['commit']}; synthetic batches; MFU on real tokens (computed FLOPs, padding included, in "
             f"brackets); tok/s: all repeats' mean (median, min-max of the repeats)", "",
             "| workload | switches | max_tokens | compute / loss | target tok/s | step ms | MFU real (computed) | "
             "waste pad / pad-to-multiple | GPU busy | kernel ms / launches per step | host ms / step | "
             "syncs/step (flag waits) | peak GiB (reserved) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        sp = r["tgt_tokens_per_s_spread"]
        syncs = "n/a" if r["host_syncs_per_step"] is None else f"{r['host_syncs_per_step']:.2f}"
        lines.append(
            f"| {r['workload']} | {r['switches']} | {r['max_tokens']} | {r['compute']} / {r.get('loss', '?')} | "
            f"{r['tgt_tokens_per_s']:,.0f} ({sp['median']:,.0f}, {sp['min']:,.0f}-{sp['max']:,.0f}) | "
            f"{r['step_ms']:.1f} | {_pct(r['mfu'])} ({_pct(r['mfu_computed'])}) | "
            f"{_pct(r['waste_padding'])} / {_pct(r['waste_pad_multiple'])} | {_pct(r['busy'])} | {_kernels(r)} | "
            f"{_host(r)} | {syncs} ({r['flag_waits_per_step']:.2f}) | {_memory(r)} |")
    for s in skipped:
        lines.append(f"| {s['workload']} | {s['switches']} | | | {s['why']} | | | | | | | | |")
    if loss_text:
        lines += ["", "```", loss_text.strip(), "```"]
    profiled = [r for r in records if r.get("top_ops")]
    chosen = [r for name in top_of for r in profiled if r["workload"] == name and r["switches"] == "eager"]
    for r in chosen or profiled[:1]:
        kind = "kernels by self GPU time" if r["top_ops_kind"] == "kernels_self_device" else "ops by self CPU time"
        lines += ["", f"Top {len(r['top_ops'])} {kind}, {r['workload']} [{r['switches']}] "
                      f"({r['profile_steps']} profiled steps; ms per step, share of all):", "",
                  "| ms/step | share | calls/step | name |", "|---|---|---|---|"]
        lines += [f"| {t['self_ms']:.3f} | {100 * t['share']:.1f}% | {t['calls']} | `{t['name'][:100]}` |"
                  for t in r["top_ops"]]
    compiled = [r for r in records if r.get("compile_cache")]
    if compiled:  # what a carried compile cache (bench_gpu.py --compile-cache) saved each compiled run
        lines += ["", "Compiled runs' warm-up (inductor's graphs found in its cache / compiled anew): " + "; ".join(
            f"{r['workload']} [{r['switches']}] {r['warmup_s']:.0f} s ({r['compile_cache']['hits']} / "
            f"{r['compile_cache']['misses']})" for r in compiled)]
    kept = [r for r in records if r.get("trace")]
    if kept:  # the files a lease brings back besides the numbers
        lines += ["", "Kept beside the records: " + "; ".join(
            f"{r['workload']} [{r['switches']}]: `{Path(r['trace']).name}` (timeline, Perfetto)" + (
                f", `{r['compiled_code']}` (compiled code)" if r.get("compiled_code") else "") for r in kept)]
    families = [r for r in profiled if (r.get("kernel_account") or {}).get("families")]
    if families:  # every kernel, by family: where the device time of each profiled run went
        names = sorted({f for r in families for f in r["kernel_account"]["families"]},
                       key=lambda f: -sum(r["kernel_account"]["families"].get(f, 0.0) for r in families))
        lines += ["", "Kernel time by family (ms per step, all kernels of the profile window; "
                      "transformer/training/tools/profiling.py names them):", "",
                  "| workload | switches | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        lines += [f"| {r['workload']} | {r['switches']} | " + " | ".join(
            f"{r['kernel_account']['families'].get(f, 0.0):.2f}" for f in names) + " |" for r in families]
    return "\n".join(lines)


def _host(r: dict) -> str:
    """The host's time a step (data wait and queuing the step), from records that have it."""
    return f"{r['host_step_ms']:.1f}" if r.get("host_step_ms") is not None else "n/a"


def _kernels(r: dict) -> str:
    account = r.get("kernel_account") or {}
    return f"{account['kernel_ms']:.1f} / {account['launches']:,.0f}" if "kernels" in account else "n/a"
