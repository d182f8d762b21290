"""`transformer-bench`'s report for people: the record of transformer/training/tools/bench.py as an aligned table (the
JSON line printed after it carries the same numbers)."""
from transformer.training.tools.profiling import top_table


def host_line(r: dict) -> str:
    """The host's time a step: waiting for data, then queuing each phase. Near the step time, the host sets the
    pace (or waits on a full launch queue: the kernel time below tells which); well under it, the device."""
    names = {"forward_backward": "forward+backward", "communication": "statistics", "optimizer": "update"}
    phases = ", ".join(f"{names.get(k, k)} {v:.2f}" for k, v in r["host_ms"].items())
    return (f"{r['host_step_ms']:9.2f} ms  {100 * r['host_step_ms'] / r['step_ms']:5.1f}%  (data wait "
            f"{r['data_wait_ms']:.2f}, then queuing {phases})")


def table(r: dict) -> str:
    """The human-readable report (the JSON line carries the same numbers)."""
    def ms(key):
        v = r[key]
        return "n/a (one worker)" if v is None else f"{v:9.2f} ms  {100 * v / r['step_ms']:5.1f}%"

    mdl = r["model"]
    depth = f"N={mdl['N']}" + (f" N_dec={mdl['N_dec']}" if mdl["N_dec"] != mdl["N"] else "")
    head = (f"transformer-bench | {r['device']} x{r['workers']} | torch {r['torch']} | commit {r['commit']}\n"
            f"model {depth} d_model={mdl['d_model']} d_ff={mdl['d_ff']} h={mdl['h']} "
            f"vocab {mdl['src_vocab_size']}/{mdl['tgt_vocab_size']} ({r['params_m']}M params) | {r['compute']} | "
            f"compile {r['compile']} | data {r['data']} max_tokens={r['max_tokens']} accumulate={r['accumulate']}")
    if r["mfu"] is not None:
        sp = r["mfu_spread"]
        mfu = (f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:.4g} TFLOP/s ({r.get('peak_source')}) on real tokens "
               f"(repeats {100 * sp['min']:.1f}-{100 * sp['max']:.1f}%); {100 * r['mfu_computed']:.1f}% counting "
               "padding")
    else:
        mfu = "n/a (no known peak: set bench.peak_tflops)" if r["device"] != "cpu" else "n/a on CPU"
    sp = r["tgt_tokens_per_s_spread"]
    rows = [
        ("target tokens/s (real)", f"{r['tgt_tokens_per_s']:,.0f}  (median of {r['repeats']} repeats "
                                   f"{sp['median']:,.0f}, min {sp['min']:,.0f}, max {sp['max']:,.0f})"),
        ("source tokens/s (real)", f"{r['src_tokens_per_s']:,.0f}"),
        ("sentences/s", f"{r['sentences_per_s']:,.1f}"),
        ("target padding", f"{100 * r['target_padding']:.1f}%"),
        ("step time", f"{r['step_ms']:9.2f} ms  ({r['repeats']} x {r['steps']} timed steps after "
                      f"{r['warmup_steps']} warm-up steps, {r['warmup_s']:.1f} s; loader workers "
                      f"{r['loader_workers']})"),
        ("  data wait (host)", ms("data_wait_ms")),
        ("  forward+backward", ms("forward_backward_ms")),
        ("  communication", ms("communication_ms")),
        ("  optimizer", ms("optimizer_ms")),
        ("  other (host, not overlapped)", ms("other_ms")),
        ("host time / step", host_line(r)),
        ("peak memory", f"{r['peak_mem_gb']:.2f} GiB ({r['peak_mem_kind']})"),
        ("model FLOPs / step", f"{r['flops_per_step'] / 1e12:.4g} TFLOP on real tokens (per worker); "
                               f"{r['flops_computed_per_step'] / 1e12:.4g} computed"),
        ("  waste: padding", f"{100 * r['waste_padding']:.1f}% of computed FLOPs (to each batch's longest)"),
        ("  waste: pad to multiple", f"{100 * r['waste_pad_multiple']:.1f}% of computed FLOPs " + (
            f"(static shapes: rows and lengths, {r['shapes']} shapes)" if r.get("static_shapes") else
            f"(trainer.pad_to_multiple={r['pad_to_multiple']})")),
        ("achieved", f"{r['achieved_tflops']:.4g} TFLOP/s on real tokens (per worker)"),
        ("MFU", mfu),
    ]
    probes = r.get("peak_probes")
    if probes:  # a CPU's measured peak: a probe that met a busy neighbour reads low
        rows.append(("  peak probes", " / ".join(f"{p:.4g}" for p in probes) + " TFLOP/s before / after the timed "
                     "steps: the higher counts" + ("; they differ by over 20%: the machine was busy"
                                                   if min(probes) < 0.8 * max(probes) else "")))
    rows.append(("host syncs / step", f"{r['flag_waits_per_step']:.2f} stop-flag event waits; " + (
        f"{r['host_syncs_per_step']:.2f} synchronising calls (sync debug mode, profile window)"
        if r["host_syncs_per_step"] is not None else "synchronising calls: n/a (GPU only)")))
    account = r.get("kernel_account")
    if account and "kernels" in account:
        rows.append(("kernels / step", f"{account['kernels']:,.0f}, {account['kernel_ms']:.2f} ms of device time "
                                       f"({100 * account['kernel_ms'] / r['step_ms']:.0f}% of the step), queued "
                                       f"by {account['launches']:,.0f} host launch calls (profile window)"))
        rows.append(("  by family", ", ".join(f"{k} {v:.2f} ms" for k, v in account["families"].items())))
    elif account:
        rows.append(("operators / step", f"{account['ops']:,.0f} aten calls, nested ones included (profile window)"))
    if r["top_ops"] is not None:
        rows.append(("device busy", f"{100 * r['busy']:.1f}% of the profile window ({r['profile_steps']} steps)"
                     if r["busy"] is not None else f"n/a on CPU ({r['profile_steps']} steps profiled)"))
    if r.get("trace"):
        rows.append(("trace", f"{r['trace']} (the profile window's timeline: ui.perfetto.dev)"))
    if r.get("cuda_graphs_captured") is not None:  # a capture costs a few steps' time: timed ones count it
        rows.append(("CUDA graphs captured", f"{r['cuda_graphs_captured']} micro-batch shapes "
                                             f"({r['cuda_graphs_captured_timed']} during the timed steps)"))
    if r["graphs"] is not None:
        rows.append(("compiled graphs", f"{r['graphs']} ({r['graphs_during_timed']} during the timed steps)"))
    cache = r.get("compile_cache")
    if cache:
        rows.append(("compile cache", f"{cache['hits']} compiled graphs found in inductor's cache, {cache['misses']} "
                                      f"compiled anew; warm-up {r['warmup_s']:.1f} s"))
    width = max(len(k) for k, _ in rows)
    lines = [head, "-" * len(head.splitlines()[0])] + [f"{k:<{width}}  {v}" for k, v in rows]
    if r["top_ops"] is not None:
        lines.append(top_table(r["top_ops"], r["top_ops_kind"] == "kernels_self_device"))
    return "\n".join(lines)
