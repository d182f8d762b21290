"""transformer-bench on CPU: a sane table and JSON line, no files left behind, bad input in one line."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.benchmarks import load_benchmark
from tests.helpers.cli import cli_env
from tests.helpers.data import MULTI30K, needs_multi30k
from tests.helpers.inprocess import bench_in_process
from transformer.training.speed.speedups import native_bf16_cpu
from transformer.training.tools.peak import peak_tflops

TINY = ("model=tiny", "model.N=1", "bench.synthetic=true", "bench.sentences=400", "bench.vocab_size=500",
        "bench.max_len=40", "data.max_tokens=600", "bench.warmup=1", "bench.steps=3", "bench.repeats=2",
        "bench.profile_steps=1", "trainer.progress=false")
# The compiled runs' model in fp32: their claims are about graphs, and under bf16 autocast on a CPU AOTAutograd's
# cache bypasses the attention's fp32 region (docs/benchmarks/2026-12-02-cpu-bf16.md), so every such run would
# compile its joint graph anew where fp32 runs find the ones before them in inductor's cache.
COMPILED = ("model.d_model=32", "model.d_ff=64", "model.h=2", "trainer.compile=true", "trainer.precision=fp32")


def bench(cwd: Path, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "transformer.cli.bench", *overrides], cwd=cwd, env=cli_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == expect, res.stderr[-4000:]
    return res


def record(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_bench_prints_a_sane_table_and_json_line(tmp_path):
    res = bench(tmp_path, *TINY, "bench.peak_tflops=0.5")
    r = record(res)
    # precision=auto in a subprocess, where conftest's fp32 patch does not reach: bf16 exactly where the CPU has
    # bf16 units (a Zen 5 EPYC, an AMX Xeon), fp32 elsewhere (an AVX2 EPYC), said in a line. native_bf16_cpu was
    # imported at collection, before that patch
    assert r["device"] == "cpu" and r["steps"] == 3 and r["repeats"] == 2 and r["data"] == "synthetic"
    assert r["compute"] == ("bf16" if native_bf16_cpu() else "fp32")
    assert "trainer.precision=auto: " + r["compute"] + " (this CPU " in res.stderr
    assert r["model"]["N"] == 1 and r["model"]["tgt_vocab_size"] == 500
    assert 0 < r["tgt_tokens_per_s"] and 0 < r["src_tokens_per_s"] and 0 < r["sentences_per_s"]
    # Tokens per sentence: synthetic lengths are ~N(27, 12) clipped to [2, 40], + </s>.
    assert 10 < r["tgt_tokens_per_s"] / r["sentences_per_s"] < 41
    assert 0 <= r["target_padding"] < 0.5
    # The split accounts for the step time: its parts are positive and add up to it.
    parts = [r[k] for k in ("data_wait_ms", "forward_backward_ms", "optimizer_ms", "other_ms")]
    assert all(p >= 0 for p in parts) and r["forward_backward_ms"] > 0 and r["communication_ms"] is None
    assert sum(parts) == pytest.approx(r["step_ms"], rel=0.02)
    # The host's own time: on a CPU the phases themselves (one worker's communication phase is the statistics).
    assert r["host_ms"]["forward_backward"] == pytest.approx(r["forward_backward_ms"])
    assert r["host_ms"]["optimizer"] == pytest.approx(r["optimizer_ms"]) and r["host_ms"]["communication"] >= 0
    assert r["host_step_ms"] == pytest.approx(r["data_wait_ms"] + sum(r["host_ms"].values()))
    assert r["host_step_ms"] <= r["step_ms"] * 1.001
    # FLOP rate = FLOPs per step x steps x repeats / time; MFU against the given peak.
    assert r["flops_per_step"] > 1e6
    assert r["achieved_tflops"] * 1e12 == pytest.approx(r["flops_per_step"] * 3 * 2 / r["wall_s"], rel=1e-3)
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 0.5, rel=1e-6)
    assert r["peak_source"] == "bench.peak_tflops" and r["peak_probes"] is None  # a given peak: nothing probed
    # Useful work is the real tokens': padding is waste, so MFU on real tokens is at most the computed count's.
    assert 0 < r["waste_padding"] < 0.5 and r["waste_pad_multiple"] == 0  # eager: no pad-to-multiple
    assert r["flops_per_step"] == pytest.approx(r["flops_computed_per_step"] * (1 - r["waste_padding"]), rel=1e-9)
    assert r["mfu"] <= r["mfu_computed"] and r["mfu"] == pytest.approx(r["mfu_computed"] * (1 - r["waste_padding"]))
    # The spread of the repeats brackets their median, and the whole run's rate lies within it.
    for key in ("tgt_tokens_per_s_spread", "mfu_spread"):
        sp = r[key]
        assert 0 < sp["min"] <= sp["median"] <= sp["max"]
    assert r["tgt_tokens_per_s_spread"]["min"] * 0.999 <= r["tgt_tokens_per_s"]
    assert r["tgt_tokens_per_s"] <= r["tgt_tokens_per_s_spread"]["max"] * 1.001
    # The profile window: top operators by self CPU time (no device timeline on a CPU, so no busy fraction).
    assert r["profile_steps"] == 1 and r["busy"] is None and r["top_ops_kind"] == "ops_self_cpu"
    assert r["flag_waits_per_step"] == 0 and r["host_syncs_per_step"] is None  # CPU: flags are read directly
    assert 1 <= len(r["top_ops"]) <= 15 and any(t["name"] in ("aten::mm", "aten::addmm") for t in r["top_ops"])
    assert r["kernel_account"]["ops"] > sum(t["calls"] for t in r["top_ops"])  # every operator, not the top's
    assert all(a["self_ms"] >= b["self_ms"] > 0 for a, b in zip(r["top_ops"], r["top_ops"][1:], strict=False))
    for row in ("target tokens/s (real)", "forward+backward", "model FLOPs / step", "waste: padding", "MFU",
                "top ", "operators by self CPU time", "operators / step", "host time / step", "then queuing"):
        assert row in res.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, no .hydra, no outputs/


def test_bench_out_appends_the_json_line(tmp_path):
    out = tmp_path / "results" / "bench.jsonl"
    bench_in_process(tmp_path, *TINY, "bench.warmup=0", "bench.steps=1", "bench.repeats=1", "bench.profile=false",
                     f"bench.out={out}")
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 1


def test_bench_trace_writes_the_profile_window_for_perfetto(tmp_path):
    """bench.trace: the profile window's timeline as gzipped Chrome trace JSON, made through a temporary file
    that is gone afterwards, named in the record and the table."""
    import gzip

    trace = tmp_path / "traces" / "tiny.trace.json.gz"
    res = bench_in_process(tmp_path, *TINY, "bench.warmup=0", "bench.steps=1", "bench.repeats=1",
                           f"bench.trace={trace}")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    ops = {e.get("name") for e in events}
    assert "aten::mm" in ops or "aten::addmm" in ops  # the step's operators, not an empty timeline
    assert record(res)["trace"] == str(trace) and f"{trace} (the profile window's timeline" in res.stdout
    assert [p.name for p in trace.parent.iterdir()] == [trace.name]


def test_bench_bad_input_is_one_line_exit_2(tmp_path):
    """In this process; test_contract.py starts the command for a bad override and bench.steps=0."""
    res = bench_in_process(tmp_path, *TINY, "bench.steps=0", expect=2)
    assert res.stderr.strip().splitlines()[-1] == "error: bench.steps=0: must be >= 1"
    res = bench_in_process(tmp_path, *TINY, "bench.min_len=700", "bench.max_len=900", expect=2)  # > data.max_tokens
    assert "data.max_tokens=600" in res.stderr.strip().splitlines()[-1]
    res = bench_in_process(tmp_path, *TINY, "bench.trace=t.json", "bench.profile=false", expect=2)
    assert res.stderr.strip().splitlines()[-1] == ("error: bench.trace='t.json': needs bench.profile=true (it is "
                                                   "that window's)")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")  # a trace asked for under a file: refused before any step runs
    res = bench_in_process(tmp_path, *TINY, f"bench.trace={tmp_path / 'file' / 't.json'}", expect=2)
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: bench.trace='{tmp_path / 'file' / 't.json'}': "
                                                          "cannot make its folder")
    assert "target tokens/s" not in res.stdout and list(tmp_path.iterdir()) == [tmp_path / "file"]


def test_bench_at_a_recipe_micro_batch_with_loader_workers(tmp_path):
    """The WMT14 recipe's own per-GPU data.max_tokens (synthetic batches of its size), batches collated by a
    DataLoader worker as in training, eager steps (speed=eager: the recipe's GPU preset has no CPU step): no
    pad-to-multiple waste."""
    r = record(bench_in_process(tmp_path, "experiment=wmt14_base", "speed=eager", *TINY, "data.max_tokens=3300",
                                "data.num_workers=1", "bench.warmup=0", "bench.repeats=1", "bench.steps=1",
                                "bench.profile=false"))
    assert r["max_tokens"] == 3300 and r["loader_workers"] == 1 and r["top_ops"] is None
    assert r["tgt_tokens_per_s"] * r["wall_s"] > 1000  # timed at the recipe's size, not a ramp's


def test_warm_up_goes_on_until_captures_stop(monkeypatch):
    """bench.warmup is a minimum under CUDA graphs: a capture at warm-up steps 1, 5 and 20 (the rare shapes come
    late) keeps it going to step 40, 20 quiet steps later; `limit` caps it; several workers never add steps."""
    from types import SimpleNamespace

    from transformer.training.tools import bench as bench_module

    trainer = SimpleNamespace(graphs=SimpleNamespace(micro={}), tcfg=SimpleNamespace(compile=False),
                              env=SimpleNamespace(world_size=1))
    steps = []

    def one_step(t, batches, n, progress, *rest):
        steps.append(n)
        if len(steps) in (1, 5, 20):
            t.graphs.micro[len(steps)] = "captured"

    monkeypatch.setattr(bench_module, "run_steps", one_step)
    assert bench_module.settle(trainer, None, limit=200) == 40 and len(trainer.graphs.micro) == 3
    steps.clear()
    trainer.graphs.micro.clear()
    assert bench_module.settle(trainer, None, limit=12) == 12
    trainer.env.world_size = 2
    assert bench_module.settle(trainer, None, limit=200) == 0
    trainer.env.world_size, trainer.graphs = 1, None
    assert bench_module.settle(trainer, None, limit=200) == 0  # eager: bench.warmup as given


def test_padding_waste_is_counted_exactly_on_a_hand_built_batch():
    """Two sentences of (source, target) lengths (3, 2) and (5, 4), padded to (5, 4) and, with
    pad_to_multiple=8, run at (8, 8): useful FLOPs are each sentence's own, the rest is waste of two kinds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from transformer.config import ModelConfig
    from transformer.data.batch import Batch
    from transformer.model import Transformer
    from transformer.model.flops import real_flops, training_flops
    from transformer.training.components.loss import label_smoothed_cross_entropy
    from transformer.training.tools.bench import Totals

    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=16, d_ff=32, h=2), 50, 70)
    args = model.args
    src = torch.tensor([[7, 8, 2, 0, 0], [7, 8, 9, 10, 2]])
    tgt_in = torch.tensor([[1, 9, 0, 0], [1, 9, 10, 11]])
    tgt_out = torch.tensor([[9, 2, 0, 0], [9, 10, 11, 2]])
    totals = Totals(args, 8)
    totals.add([Batch(src, tgt_in, tgt_out, torch.arange(2), 6)], 0.0)
    assert totals.flops_real == totals.tgt == 0 and not totals.shapes  # no counting inside the timed steps ...
    assert totals.tally() is totals  # ... but after them
    one = training_flops(args, 1, 3, 2) + training_flops(args, 1, 5, 4)
    assert totals.flops_real == one == real_flops(args, [3, 5], [2, 4])
    assert totals.flops_batch == training_flops(args, 2, 5, 4) > one
    assert totals.flops_run == training_flops(args, 2, 8, 8) > totals.flops_batch
    assert (totals.tgt, totals.src, totals.sentences, totals.slots) == (6, 8, 2, 8)
    # The per-sentence sum is what the model computes on each sentence alone (FlopCounterMode, as test_flops).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        for i, (s, t) in enumerate(((3, 2), (5, 4))):
            logits = model(src[i:i + 1, :s], tgt_in[i:i + 1, :t])
            label_smoothed_cross_entropy(logits, tgt_out[i:i + 1, :t], 0.1, 0)[0].backward()
    assert fc.get_total_flops() == pytest.approx(one, rel=0.05)


def test_busy_fraction_counts_overlapping_kernels_once():
    from transformer.training.tools.profiling import busy_fraction

    assert busy_fraction([(0, 2), (1, 3), (5, 6)], (0, 10)) == pytest.approx(0.4)
    assert busy_fraction([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4 / 6)  # first start to last end
    assert busy_fraction([(-1, 1), (9, 12)], (0, 10)) == pytest.approx(0.2)  # clipped to the window
    assert busy_fraction([]) is None


def test_top_operators_lists_kernels_by_self_device_time_per_step():
    """On a GPU the top list holds kernels alone (a CPU operator's device time is its kernels', counted twice
    otherwise), per profiled step, with their share of all kernel time."""
    from types import SimpleNamespace as NS

    from transformer.training.tools.profiling import top_operators

    avgs = [NS(key="aten::mm", device_type="DeviceType.CPU", count=4, self_device_time_total=900.0,
               self_cpu_time_total=50.0),
            NS(key="sm90_gemm", device_type="DeviceType.CUDA", count=4, self_device_time_total=600.0,
               self_cpu_time_total=0.0),
            NS(key="softmax_kernel", device_type="DeviceType.CUDA", count=2, self_device_time_total=300.0,
               self_cpu_time_total=0.0)]
    top = top_operators(avgs, device=True, rows=15, steps=2)
    assert [t["name"] for t in top] == ["sm90_gemm", "softmax_kernel"]
    assert top[0] == {"name": "sm90_gemm", "calls": 2, "self_ms": 0.3, "share": pytest.approx(2 / 3)}
    assert [t["name"] for t in top_operators(avgs, device=False, rows=1, steps=1)] == ["aten::mm"]


def test_kernel_families_name_the_kernels_of_real_profiles():
    """Names from the H200 profiles of docs/benchmarks/2026-11-gpu.md: compiled kernels are told apart by what
    they fuse."""
    from transformer.training.tools.profiling import kernel_family

    names = {
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIte":
            "copy, cast, cat",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::Opaq":
            "copy, cast, cat",
        "fmha_cutlassB_bf16_aligned_64x64_k64_dropout_sm80(PyTorchMemEffAttention::AttentionBackwardKernel":
            "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "triton_red_fused__log_softmax_backward_data__to_copy_add_expand_masked_fill_neg_unsqueeze_view_2": "loss",
        "triton_per_fused__to_copy_add_native_dropout_backward_native_layer_norm_backward_view_6":
            "compiled (Triton)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::Fuse":
            "optimizer",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u": "layer norm",
        "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, unsigned": "dropout",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrap": "reduction",
        "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIter": "elementwise",
        "Memcpy HtoD (Pinned -> Device)": "copy, cast, cat",
        "some_new_kernel": "other",
    }
    assert {n: kernel_family(n) for n in names} == names


def test_kernel_account_sums_every_kernel_per_step_and_counts_launches():
    """All device activity is accounted for, by family, per step; user annotations (an optimizer step's range on
    the device timeline, gaps included) are neither kernels nor busy time; launches are the host's queueing calls."""
    from types import SimpleNamespace as NS

    from transformer.training.tools.profiling import device_events, kernel_account

    def ev(name, start, end, device="DeviceType.CUDA", annotation=False):
        return NS(name=name, device_type=device, is_user_annotation=annotation, time_range=NS(start=start, end=end))

    events = [ev("nvjet_sm90_tst_128x128", 0, 3000), ev("flash_fwd_kernel", 3000, 4000),
              ev("triton_poi_fused_native_dropout_relu_view_18", 4000, 4500), ev("nvjet_sm90_tst_64x64", 5000, 6000),
              ev("Optimizer.step#Adam.step", 4000, 9000, annotation=True),
              ev("cudaLaunchKernel", 0, 5, device="DeviceType.CPU"),
              ev("cuLaunchKernel", 5, 9, device="DeviceType.CPU"),
              ev("cudaGraphLaunch", 9, 12, device="DeviceType.CPU"), ev("aten::mm", 0, 20, device="DeviceType.CPU")]
    account = kernel_account(events, steps=2, cuda=True)
    assert account["kernels"] == 2 and account["launches"] == 1.5
    assert account["families"] == {"matmul": 2.0, "attention": 0.5, "compiled (Triton)": 0.25}
    assert list(account["families"]) == ["matmul", "attention", "compiled (Triton)"]  # largest first
    assert account["kernel_ms"] == pytest.approx(2.75)
    assert "Optimizer.step#Adam.step" not in {e.name for e in device_events(events)}
    assert kernel_account(events, steps=2, cuda=False) == {"ops": 0.5}  # a CPU: aten calls per step


def test_peak_table_matches_device_names():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756
    assert peak_tflops("NVIDIA H200", "tf32") == 495
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156
    assert peak_tflops("NVIDIA L40S", "bf16") == 362  # not the L4's
    assert peak_tflops("NVIDIA L4", "bf16") == 121
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_tflops("NVIDIA A10G", "bf16") is None  # not in the table: bench.peak_tflops
    assert peak_tflops("NVIDIA GeForce RTX 3090", "fp32") is None


@pytest.mark.slow
@needs_multi30k
def test_bench_on_multi30k_batches(tmp_path):
    folder = tmp_path / "root" / "multi30k"  # an offline data root: the raw files, linked
    folder.mkdir(parents=True)
    for f in MULTI30K.glob("*.gz"):
        (folder / f.name).symlink_to(f.resolve())
    r = record(bench(tmp_path, "experiment=multi30k", "model=tiny", f"data.root={tmp_path / 'root'}",
                     "bench.warmup=1", "bench.steps=3", "trainer.progress=false"))
    assert r["data"] == "multi30k" and r["model"]["src_vocab_size"] > 5000  # the recipe's joint BPE vocabulary
    # tokenizer.tgt_vocab=seen: the output layer scores only the types seen on the English side, a subset
    assert 4000 < r["model"]["tgt_vocab_size"] < r["model"]["src_vocab_size"]
    assert r["max_tokens"] == 2048  # the recipe's batches after its ramp of smaller ones
    assert r["tgt_tokens_per_s"] * r["wall_s"] / r["steps"] > 1024  # timed at that size, not the ramp's 512
    assert r["target_padding"] < 0.2  # token-bucketed batches of similar lengths
    assert r["tgt_tokens_per_s"] > 0
    # No bench.peak_tflops on a CPU: torch.mm probed just before and just after the timed steps, the higher counts.
    assert len(r["peak_probes"]) == 2 and r["peak_tflops"] == max(r["peak_probes"]) > 0
    assert r["peak_source"] == f"torch.mm {r['compute']} at the model's shapes" and 0 < r["mfu"] < r["mfu_computed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


@pytest.mark.slow
@pytest.mark.parametrize("multiple", [None, 8])
def test_bench_compiled_model_uses_one_graph_for_all_batch_shapes(tmp_path, multiple):
    """torch.compile with batch size and lengths marked dynamic, lengths as they come (the default) or rounded
    up to a multiple of 8: batches of many shapes run through one graph, none compiled in the timed steps."""
    pad = [f"trainer.pad_to_multiple={multiple}"] if multiple else []
    r = record(bench(tmp_path, *TINY, *COMPILED,
                     "bench.warmup=3", "bench.steps=4", *pad))
    assert r["compile"] is True and r["pad_to_multiple"] == (multiple or 1) and r["shapes"] >= 4
    assert r["graphs"] == 1 and r["graphs_during_timed"] == 0
    assert (r["waste_pad_multiple"] > 0) == (multiple == 8)


@pytest.mark.slow
def test_bench_compiled_model_uses_one_graph_for_all_static_shapes(tmp_path):
    """trainer.static_shapes under torch.compile (as with CUDA graphs): the ladder's shapes run through one
    compiled graph from the start (unmarked, the second shape compiled the model a second time)."""
    r = record(bench(tmp_path, *TINY, *COMPILED,
                     "trainer.static_shapes=true", "bench.warmup=4", "bench.steps=4"))
    assert r["static_shapes"] is True and r["shapes"] >= 4  # several static shapes were run
    assert r["graphs"] == 1 and r["graphs_during_timed"] == 0


@pytest.mark.slow
def test_bench_compiled_unpadded_model_stops_recompiling_after_warm_up(tmp_path):
    """torch.compile with unpadded attention: the packings' token and sentence counts vary too, as do the padded
    lengths; no branch on those sizes, so after at most one recompilation (the sizes made dynamic) no batch
    compiles a graph. Before the fix: a recompilation every few steps."""
    r = record(bench(tmp_path, *TINY, *COMPILED,
                     "trainer.unpadded_attention=true", "model.dropout=0.0", "bench.warmup=4", "bench.steps=4"))
    assert r["compile"] is True and r["graphs"] <= 2 and r["graphs_during_timed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("trainer.unpadded_attention=true", "trainer.static_shapes=true")],
                         ids=["padded", "packed_budgets"])
def test_bench_layer_compiled_model_uses_two_graphs_for_every_layer_and_shape(tmp_path, extra):
    """trainer.compile_scope=layers: an encoder layer's graph and a decoder layer's, whatever N (2 here) and the
    batch shapes, padded as they come or packed to token budgets; none compiled in the timed steps."""
    r = record(bench(tmp_path, *TINY, "model.N=2", *COMPILED, "trainer.compile_scope=layers", "bench.warmup=3",
                     "bench.steps=4", *extra))
    assert r["compile_scope"] == "layers" and r["shapes"] >= 3
    assert r["graphs"] == 2 and r["graphs_during_timed"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_under_torchrun_reports_the_whole_job(tmp_path):
    """Two gloo workers: tokens/s summed over both, the statistics all-reduce timed, one report (rank 0)."""
    from tests.helpers.dist import env_for, torchrun_cmd

    cmd = torchrun_cmd(*TINY, "trainer.accelerator=cpu")
    cmd[cmd.index("transformer.train")] = "transformer.cli.bench"
    res = subprocess.run(cmd, cwd=tmp_path, env=env_for(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone reports
    r = json.loads(lines[0])
    assert r["workers"] == 2 and r["communication_ms"] is not None and r["communication_ms"] >= 0
    assert r["sentences_per_s"] > 0 and list(tmp_path.iterdir()) == []


def test_bench_gpu_skips_decoding_without_spacy_and_says_how(tmp_path, monkeypatch, capsys):
    """GPU machines often lack spaCy (the H200 lent on 2026-11-26 did): the random model's vocabularies need it,
    so make bench-gpu says so in one line and records the skip instead of printing a traceback."""
    import importlib.util

    bench_gpu = load_benchmark("bench_gpu")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "spacy" else real_find_spec(name))
    monkeypatch.setattr(bench_gpu.subprocess, "run", lambda *a, **k: pytest.fail("bench_decode.py was started"))
    out = tmp_path / "bench.jsonl"
    bench_gpu.run_decode(out, None)
    assert "--decode-checkpoint" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"kind": "decode", "skipped": "spacy not importable"}


def test_bench_gpu_plan_covers_the_sizes_and_skips_switches_this_checkout_lacks():
    """The prepared GPU script's table: every workload eager (the recipes' micro-batches, 16k, big at 32k),
    each switch set at 16k and the recipe sizes; a set naming a key the config lacks (a switch still on
    another branch) is skipped and said so; a dry run runs each set as a CPU can, without compilation."""
    import argparse

    bench_gpu = load_benchmark("bench_gpu")
    keys = bench_gpu.config_keys()
    assert {"trainer.loss", "trainer.compile", "data.max_tokens", "bench.profile"} <= keys
    args = argparse.Namespace(switch=["wishful=model.no_such_switch=true", "small_batches=data.max_tokens=8000"],
                              only=None, sets=None, dry_run=False, out=Path("/tmp/bench-gpu-x.jsonl"),
                              skip_tests=True, compile_cache=None)  # a lease's first call
    todo, skipped = bench_gpu.plan(args, keys)
    runs = {(w, s) for w, s, _ in todo}
    assert {(w, "eager") for w in ("multi30k", "base@recipe", "base@16k", "big@recipe", "big@16k", "big@32k")} <= runs
    assert {("big@16k", "compile"), ("base@recipe", "loss=reference"), ("big@16k", "small_batches"),
            ("big@16k", "compile+bf16_residual"), ("base@16k", "unpadded"), ("big@16k", "fp8"),
            ("big@16k", "compile+fp8"), ("big@16k", "cuda_graphs"), ("base@16k", "cuda_graphs"),
            ("base@16k", "static_shapes"), ("big@recipe", "acc8+fit")} <= runs
    order = [(w, s) for w, s, _ in todo]
    assert order[:len(bench_gpu.HEAD)] == bench_gpu.HEAD  # before the GPU tier: the defaults
    assert order[:2] == [("big@16k", "eager"), ("base@16k", "eager")]
    assert ("big@16k", "loss=fused") in runs and ("multi30k", "cuda_graphs") in runs
    # next: base with the dropout the paper's models had before (eager, what Section 5.4's placement buys); the
    # candidates for the targets, every switch on packed token budgets, compiled whole and per layer,
    # and those budgets graphed alone (at 16k and on Multi30k's batches), then compile on packed tokens, packed
    # tokens without inductor's mix-order reduction, and every switch on the padded ladder; questions of
    # defaults after them
    # the presets (conf/speed/) right after HEAD; the rest of the plan in its order
    assert order[2:2 + len(bench_gpu.PRESETS)] == bench_gpu.PRESETS
    after = [("base@16k", "dropout_everywhere"),
             ("big@16k", "all+unpadded"), ("big@16k", "all+unpadded+layers"),
             ("base@16k", "all+unpadded+layers"), ("base@16k", "all+unpadded"),
             ("big@16k", "cuda_graphs+unpadded"), ("base@16k", "cuda_graphs+unpadded"),
             ("multi30k", "cuda_graphs+unpadded"), ("multi30k", "cuda_graphs"),
             ("big@16k", "compile+unpadded"), ("base@16k", "compile+unpadded"),
             ("big@16k", "all+unpadded+no_mix_order"), ("base@16k", "all+unpadded+no_mix_order"),
             ("big@16k", "all"), ("base@16k", "all")]
    after = [r for r in after if r not in bench_gpu.PRESETS]  # timed earlier, with the presets
    rest = order[2 + len(bench_gpu.PRESETS):]
    assert rest[:len(after)] == after
    assert rest.index(("big@16k", "compile+bf16_residual+pad8")) == 13 and rest.index(("big@16k", "compile+fp8")) < 25
    assert ("multi30k", "cuda_graphs+unpadded") in runs
    assert order.index(("base@16k", "cuda_graphs")) < order.index(("big@16k", "loss=reference"))  # set by set
    assert {(s["workload"], s["switches"]) for s in skipped} == {("big@16k", "wishful"), ("base@16k", "wishful")}
    assert "model.no_such_switch" in skipped[0]["why"]
    overrides = dict((w, o) for w, s, o in todo if s == "eager")
    assert "experiment=wmt14_big" in overrides["big@recipe"] and "data.max_tokens=32768" in overrides["big@32k"]
    traced = {(w, s): o[-1] for w, s, o in todo if o[-1].startswith("bench.trace=")}  # what a lease keeps
    assert set(traced) == set(bench_gpu.KEEP) == {("base@16k", "eager"), ("base@16k", "all+unpadded"),
                                                  ("base@16k", "all+unpadded+layers")}
    assert traced["base@16k", "all+unpadded"].endswith("/bench-gpu-x.base-16k-all-unpadded.trace.json.gz")
    args.dry_run, args.switch = True, None
    todo, skipped = bench_gpu.plan(args, keys)
    assert all("model=tiny" in o and "trainer.compile=true" not in o and "trainer.cuda_graphs=true" not in o
               and "trainer.loss=compiled" not in o for _, _, o in todo)
    dry = {(w, s): o for w, s, o in todo}
    # a graphed set runs as its static shapes on a CPU: packed token budgets' plumbing (the sampler, the flat
    # collate, the bench's filler count) is checked before a lease
    assert {"trainer.static_shapes=true", "trainer.unpadded_attention=true",
            "trainer.bf16_residual=true", "trainer.loss=fused"} <= set(dry["big@16k", "all+unpadded"])
    assert "trainer.static_shapes=true" in dry["multi30k", "cuda_graphs+unpadded"]
    assert "bench.warmup=60" not in dry["base@16k", "cuda_graphs"]  # DRY's warm-up of 0 steps decides
    why = {(s["workload"], s["switches"]): s["why"] for s in skipped}  # a set that shrinks to one run: once
    assert why["big@16k", "static_shapes"] == "dry run: as cuda_graphs on a CPU"
    assert why["base@16k", "compile"] == "dry run: as eager on a CPU"
    assert why["base@16k", "all+unpadded"] == "dry run: as all+unpadded+layers on a CPU"  # no compile there
    assert why["big@16k", "fp8"].startswith("dry run: float8") and why["big@16k", "compile+fp8"].startswith("dry")
    assert len(dry) + len(skipped) == len(bench_gpu.PLAN)


def test_bench_gpu_keeps_the_compiled_code_of_a_traced_compiled_run(tmp_path, monkeypatch):
    """A KEEP run under torch.compile logs the generated code (TORCH_LOGS=output_code) to a file beside --out,
    gzipped, that the record names; a run without a trace, or not compiled, logs none."""
    import gzip

    bench_gpu = load_benchmark("bench_gpu")
    out, seen = tmp_path / "b.jsonl", []

    def fake(cmd, env, **kw):
        seen.append({k: env.get(k) for k in ("TORCH_LOGS", "TORCH_LOGS_OUT")})
        if env.get("TORCH_LOGS_OUT"):
            Path(env["TORCH_LOGS_OUT"]).write_text("def triton_per_fused_native_layer_norm_0(...): ...")
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"tgt_tokens_per_s": 1.0, "mfu": None}), "")

    monkeypatch.setattr(bench_gpu, "run_group", fake)
    trace = f"bench.trace={bench_gpu.kept_files(out, 'base@16k', 'all')['trace']}"
    r = bench_gpu.run_bench("base@16k", "all", ["trainer.compile=true", trace], out, tmp_path / "b.log", 60)
    assert seen[-1] == {"TORCH_LOGS": "output_code", "TORCH_LOGS_OUT": str(tmp_path / "b.base-16k-all.inductor.txt")}
    assert r["compiled_code"] == "b.base-16k-all.inductor.txt.gz"  # gzipped: the device tool's 16 MiB a file
    assert gzip.decompress((tmp_path / r["compiled_code"]).read_bytes()).decode().startswith("def triton_per_fused")
    assert not (tmp_path / "b.base-16k-all.inductor.txt").exists()
    for overrides in (["trainer.compile=true"], [trace]):
        assert bench_gpu.run_bench("base@16k", "x", overrides, out, tmp_path / "b.log", 60)["compiled_code"] is None
        assert seen[-1] == {"TORCH_LOGS": None, "TORCH_LOGS_OUT": None}


@pytest.mark.parametrize("workers", [1, 2])
def test_each_test_reports_its_outcome_as_it_ends(tmp_path, workers):
    """tests/helpers/report.py: one line per test, a failure with its message, a skip with its setup's report;
    under pytest-xdist (the GPU tier on a lent machine) still one line per test, a crashed worker's test too."""
    (tmp_path / "test_four.py").write_text(
        "import os, pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 + 1 == 3, 'arithmetic broke'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.skipif(not os.environ.get('PYTEST_XDIST_WORKER'), reason='kills the run without xdist')\n"
        "def test_crash(): os._exit(3)\n")
    log = tmp_path / "tests.jsonl"
    # not this suite's own xdist worker's variables (`pytest -n 2`), which would tell test_crash it is under xdist
    outer = {k: v for k, v in cli_env().items() if not k.startswith("PYTEST_XDIST")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.report", "-q", "-p", "no:cacheprovider",
                          *(["-n", str(workers)] if workers > 1 else []), str(tmp_path / "test_four.py")],
                         cwd=Path(__file__).resolve().parents[3],
                         env={**outer, "TRANSFORMER_TEST_LOG": str(log)}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    records = [json.loads(x) for x in log.read_text().splitlines()]
    lines = {r["test"].rsplit("::", 1)[-1]: r for r in records}
    assert len(lines) == len(records)  # once each, not once a process
    assert {k: v["outcome"] for k, v in lines.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped",
        "test_crash": "failed" if workers > 1 else "skipped"}
    assert "arithmetic broke" in lines["test_bad"]["error"] and "error" not in lines["test_ok"]
    if workers > 1:
        assert "crashed" in lines["test_crash"]["error"]


def test_bench_gpu_tier_runs_tests_in_parallel_only_where_xdist_and_cores_allow(monkeypatch):
    """Four tests at a time on a 16-core machine with pytest-xdist; serial on a small machine or without xdist."""
    tier = load_benchmark("gpu_tier")
    for cores, xdist, expect in ((16, True, 4), (64, True, 4), (8, True, 2), (2, True, 1), (16, False, 1)):
        monkeypatch.setattr(tier.os, "cpu_count", lambda c=cores: c)
        monkeypatch.setattr(tier.importlib.util, "find_spec",
                            lambda name, x=xdist: object() if name != "xdist" or x else None)
        assert tier.tier_workers() == expect, (cores, xdist)
    cmd = tier.tier_command(["tests/test_a.py", "tests/test_b.py"], 300, 4)
    assert cmd[cmd.index("-n") + 1] == "4" and cmd[-2:] == ["tests/test_a.py", "tests/test_b.py"]
    assert cmd[cmd.index("--timeout") + 1] == "150"  # half the tier when four share it
    serial = tier.tier_command(["tests/test_a.py"], 300, 1)
    assert "-n" not in serial and serial[serial.index("--timeout") + 1] == "100"  # a third alone


def test_bench_gpu_timeout_kills_the_runs_children_too(tmp_path):
    """A run cut at its timeout takes its process group with it: a child it started (a loader or xdist worker)
    does not go on using the GPU through the next run."""
    tier = load_benchmark("gpu_tier")
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen(['sleep', '60'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        tier.run_group([sys.executable, "-c", script], timeout=3, cwd=tmp_path)
    assert time.time() - t0 < 20
    child = int(e.value.output.split()[0])  # what the run printed before its end comes back

    def alive(pid: int) -> bool:  # a zombie waiting for its reaper counts as gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(child)
    res = tier.run_group([sys.executable, "-c", "print('ok')"], timeout=30)
    assert (res.returncode, res.stdout) == (0, "ok\n")


def test_bench_gpu_gives_no_run_more_than_its_cap(tmp_path, monkeypatch):
    """One run stuck compiling or capturing cannot eat a lease: each gets at most --run-timeout-s, or what is left
    of the budget if less."""
    bench_gpu = load_benchmark("bench_gpu")
    timeouts = []
    monkeypatch.setattr(bench_gpu, "run_bench", lambda w, n, o, out, log, timeout: timeouts.append(timeout))
    monkeypatch.setattr(bench_gpu, "run_loss", lambda out, log, dry: "")
    assert bench_gpu.main(["--dry-run", "--skip-tests", "--only", "base", "--run-timeout-s", "7",
                           "--out", str(tmp_path / "b.jsonl")]) == 0
    assert timeouts and all(t == 7 for t in timeouts)
    timeouts.clear()
    assert bench_gpu.main(["--dry-run", "--skip-tests", "--only", "base", "--budget-s", "40",
                           "--out", str(tmp_path / "c.jsonl")]) == 0
    assert timeouts and all(30 <= t <= 40 for t in timeouts)
    # every run "failed" here (the stand-in returns no record): under the cap, a failure; cut by the budget's end,
    # said so (a lease's summary once called such a run failed: docs/benchmarks/2026-11-gpu.md)
    assert "failed (see the log)" in (tmp_path / "b.md").read_text()
    assert "cut at the budget's end" in (tmp_path / "c.md").read_text()


def test_bench_gpu_goes_on_where_the_last_call_stopped(tmp_path, monkeypatch, capsys):
    """A call whose budget ends names the first run it left out; a further call given it (--start-at) begins there,
    without HEAD's runs or the loss benchmark again; a run not in the plan is refused in one line."""
    import types

    bench_gpu = load_benchmark("bench_gpu")
    clock, ran, losses = [1000.0], [], []

    def run(w, n, o, out, log, timeout):  # each run takes 40 s of the fake clock and "fails" under its cap
        ran.append(f"{w}:{n}")
        clock[0] += 40

    monkeypatch.setattr(bench_gpu, "time", types.SimpleNamespace(time=lambda: clock[0], strftime=time.strftime))
    monkeypatch.setattr(bench_gpu, "run_bench", run)
    monkeypatch.setattr(bench_gpu, "run_loss", lambda out, log, dry: losses.append(1) or "")
    common = ["--dry-run", "--skip-tests", "--only", "base", "--run-timeout-s", "20"]
    assert bench_gpu.main([*common, "--budget-s", "100", "--out", str(tmp_path / "a.jsonl")]) == 0
    args = types.SimpleNamespace(only="base", sets=None, switch=None, dry_run=True, out=tmp_path / "a.jsonl")
    plan = [f"{w}:{n}" for w, n, _ in bench_gpu.plan(args, bench_gpu.config_keys())[0]]
    assert ran == plan[:2] and len(losses) == 1  # 100 s: two runs of 40, then under 30 s left
    go_on = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()][-1]
    assert go_on == {"kind": "go_on", "start_at": plan[2], "runs_left": len(plan) - 2}
    assert f"--start-at {plan[2]}" in capsys.readouterr().out
    ran.clear()
    again = ["--budget-s", "100", "--start-at", plan[2], "--out", str(tmp_path / "b.jsonl")]
    assert bench_gpu.main([*common, *again]) == 0
    assert ran == plan[2:4] and len(losses) == 1
    with pytest.raises(SystemExit) as e:
        bench_gpu.main([*common, "--start-at", "base@16k:nope", "--out", str(tmp_path / "c.jsonl")])
    assert e.value.code == 2 and "--start-at: base@16k:nope is not a run" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()  # refused before anything is written


def test_bench_gpu_env_switches_set_the_runs_environment(tmp_path, monkeypatch):
    """A switch set's env.NAME=VALUE entries reach the run's environment, not its config overrides, and are
    never taken for config keys this checkout lacks; the record keeps them."""
    bench_gpu = load_benchmark("bench_gpu")
    switch = bench_gpu.SWITCH_SETS["all+unpadded+no_mix_order"]
    assert "env.TORCHINDUCTOR_MIX_ORDER_REDUCTION=0" in switch
    assert bench_gpu.missing_keys(switch, bench_gpu.config_keys()) == []
    seen = []

    def fake(cmd, env, **kw):
        seen.append((cmd, env.get("TORCHINDUCTOR_MIX_ORDER_REDUCTION")))
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"tgt_tokens_per_s": 1.0, "mfu": None}), "")
    monkeypatch.setattr(bench_gpu, "run_group", fake)
    r = bench_gpu.run_bench("base@16k", "x", ["model=base", "env.TORCHINDUCTOR_MIX_ORDER_REDUCTION=0"],
                            tmp_path / "b.jsonl", tmp_path / "b.log", 60)
    cmd, value = seen[-1]
    assert value == "0" and cmd[-1] == "model=base" and not any(a.startswith("env.") for a in cmd)
    assert r["overrides"] == ["model=base", "env.TORCHINDUCTOR_MIX_ORDER_REDUCTION=0"]


def test_bench_gpu_tier_cut_short_still_names_its_failures(tmp_path, monkeypatch, capsys):
    """The lease's clock stops the tier: the tests that ended are counted, each failure printed with its last
    line, and the record keeps them all."""
    tier = load_benchmark("gpu_tier")
    out = tmp_path / "b.jsonl"

    def cut_short(cmd, env, timeout, **kw):
        assert "-m" in cmd and "gpu" in cmd and cmd[-1].startswith("tests/")
        with open(env["TRANSFORMER_TEST_LOG"], "a") as f:
            f.write(json.dumps({"test": "tests/test_a.py::test_one", "outcome": "passed"}) + "\n")
            f.write(json.dumps({"test": "tests/test_a.py::test_two", "outcome": "failed",
                                "error": "Traceback\nRuntimeError: mat1 dims not divisible by 16"}) + "\n")
        raise subprocess.TimeoutExpired(cmd, timeout, output="..F")

    monkeypatch.setattr(tier, "run_group", cut_short)
    assert tier.run_tests(out, tmp_path / "b.log", timeout=10, dry=False) == 124
    printed = capsys.readouterr().out
    assert "gpu tier: 1 failed, 1 passed; timed out after 10 s" in printed
    assert "FAILED tests/test_a.py::test_two: RuntimeError: mat1 dims not divisible by 16" in printed
    record = json.loads(out.read_text())
    assert record["kind"] == "gpu_tests" and len(record["tests"]) == 2 and record["returncode"] == 124
    assert "mat1 dims" in (tmp_path / "b.log").read_text()


@pytest.mark.slow
def test_bench_gpu_summary_gives_each_gpu_run_its_kernel_time_launches_and_families():
    """A GPU record's kernel account reaches the summary: kernel ms, launches and host ms in its row, one row of
    kernel time by family per profiled run, families ordered by their total time."""
    markdown = load_benchmark("gpu_report").markdown
    header = {"device": "NVIDIA H200", "date": "2026-11-28", "torch": "2.11.0", "cuda": "13.0", "commit": "abc1234"}

    def rec(switches, families, launches):
        return {"workload": "base@16k", "switches": switches, "max_tokens": 16384, "compute": "bf16",
                "loss": "compiled", "tgt_tokens_per_s": 3e5, "tgt_tokens_per_s_spread": {"median": 3e5, "min": 2.9e5,
                                                                                       "max": 3.1e5},
                "step_ms": 46.2, "mfu": 0.121, "mfu_computed": 0.147, "waste_padding": 0.061,
                "waste_pad_multiple": 0.113, "busy": 0.46, "host_syncs_per_step": 0.0, "flag_waits_per_step": 0.0,
                "peak_mem_gb": 15.3, "top_ops": [{"name": "nvjet", "calls": 22, "self_ms": 1.1, "share": 0.1}],
                "host_step_ms": 44.04 if switches == "eager" else None,
                "reserved_gb": 21.25 if switches == "all" else None,  # graphed: the pools the peak leaves out
                "top_ops_kind": "kernels_self_device", "profile_steps": 5,
                "kernel_account": {"kernels": 900.0, "kernel_ms": sum(families.values()), "launches": launches,
                                   "families": families}, "warmup_s": 112.4 if switches == "all" else 2.0,
                "compile_cache": {"hits": 1, "misses": 3, "aot_hits": 0, "aot_misses": 2} if switches == "all"
                else None}

    md = markdown(header, [rec("eager", {"matmul": 12.0, "attention": 4.5}, 2400.0),
                           rec("all", {"matmul": 11.0, "compiled (Triton)": 9.0}, 3.0)], [])
    assert "| 16.5 / 2,400 | 44.0 |" in md and "| 20.0 / 3 | n/a |" in md  # host ms: a record without it, n/a
    assert "| 0.00 (0.00) | 15.3 |" in md and "| 0.00 (0.00) | 15.3 (21.2) |" in md  # reserved where recorded
    assert "| workload | switches | matmul | compiled (Triton) | attention |" in md
    assert "| base@16k | eager | 12.00 | 0.00 | 4.50 |" in md and "| base@16k | all | 11.00 | 9.00 | 0.00 |" in md
    # a compiled run's warm-up, and what it found in inductor's cache (bench_gpu.py --compile-cache)
    assert "Compiled runs' warm-up (inductor's graphs found in its cache / compiled anew): base@16k [all] 112 s " \
        "(1 / 3)" in md


@pytest.mark.slow  # seven shrunk bench runs and a loss benchmark: about 50 s on 2 cores
def test_bench_gpu_dry_run_on_cpu_writes_records_and_a_summary(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """`bench_gpu.py --dry-run`: the GPU script's plumbing on a CPU, everything shrunk: one JSON record per run,
    the header (device, date, torch, commit), a Markdown table with a row per run and the top operators; a
    graphed set on packed token budgets runs as its static shapes, a compiled one that shrinks to eager is
    skipped, and --sets picks the sets. With --compile-cache and none yet, the runs' compile caches (the loss
    benchmark's compiled loss, here) are packed beside --out. The script and its transformer-bench runs go in this
    process (the command's own process is test_bench_prints_a_sane_table_and_json_line's, run_group's
    test_bench_gpu_timeout_kills_the_runs_children_too's); the loss benchmark runs as its own process, as on a lease."""
    from tests.helpers.inprocess import call_main
    from transformer.cli import bench as bench_cli

    bench_gpu = load_benchmark("bench_gpu")
    real_run_group = bench_gpu.run_group

    def run_group(cmd, timeout, cwd=None, env=None, **kw):
        if cmd[1:3] != ["-m", "transformer.cli.bench"]:
            return real_run_group(cmd, timeout, cwd=cwd, env=env, **kw)
        res = call_main(bench_cli.main, cmd[3:], cwd, env, prog="transformer-bench")
        return subprocess.CompletedProcess(cmd, res.returncode, res.stdout, res.stderr)

    out, caches = tmp_path / "b.jsonl", tmp_path_factory.mktemp("caches")
    sets = "eager,all+unpadded,compile,loss=reference,acc8+fit"
    monkeypatch.setattr(bench_gpu, "run_group", run_group)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(caches / "inductor"))
    monkeypatch.delenv("BENCH_COMMIT", raising=False)  # main() sets it, for its runs
    monkeypatch.chdir(tmp_path)
    code = bench_gpu.main(["--dry-run", "--skip-tests", "--only", "base", "--sets", sets, "--out", str(out),
                           "--budget-s", "3000",  # the plumbing, not the budget, on a slow or loaded CPU
                           "--compile-cache", str(caches / "none-yet.tar.gz")])
    res = subprocess.CompletedProcess([], code, *capsys.readouterr())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records[0]["kind"] == "machine" and records[0]["dry_run"] and records[0]["commit"]
    benches = [r for r in records if r["kind"] == "bench"]
    assert {(r["workload"], r["switches"]) for r in benches} == {
        (w, s) for w in ("base@recipe", "base@16k") for s in ("eager", "loss=reference", "all+unpadded")
    } | {("base@recipe", "acc8+fit")}
    packed = next(r for r in benches if r["switches"] == "all+unpadded")
    assert "trainer.static_shapes=true" in packed["overrides"] and "trainer.compile=true" not in packed["overrides"]
    assert packed["waste_padding"] == 0 and packed["waste_pad_multiple"] > 0  # filler, not padding
    assert all(r["model"]["N"] == 1 and r["steps"] == 1 and r["top_ops"] for r in benches)
    assert all(r["commit"] == records[0]["commit"] for r in benches)
    md = out.with_suffix(".md").read_text()
    assert records[0]["torch"] in md and records[0]["commit"] in md
    plan = load_benchmark("bench_gpu").PLAN
    assert md.count("| base@") == len([w for w, s in plan if w.startswith("base@") and s in sets.split(",")])
    assert "| base@16k | compile | | | dry run: as eager on a CPU |" in md  # a row each, run or skipped
    assert "Top " in md and "ops by self CPU time" in md and md.strip() in res.stdout
    # base@16k eager and all+unpadded keep their timelines (a lease brings them back: names of letters, digits,
    # '.', '_' and '-'), named in the summary; nothing else is left (no compiled code: a dry run compiles nothing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.base-16k-all-unpadded.trace.json.gz",
                                                          "b.base-16k-eager.trace.json.gz", "b.compile-cache.tar.gz",
                                                          "b.jsonl", "b.log", "b.md"]
    cache = [r for r in records if r["kind"] == "compile_cache"]
    assert cache[0]["dir"] == str(caches / "inductor") and "files" not in cache[0]  # nothing to unpack
    assert cache[1]["saved"] and cache[1]["files"] > 0
    assert cache[1]["archive"] == str(tmp_path / "b.compile-cache.tar.gz")
    assert "`b.base-16k-eager.trace.json.gz` (timeline, Perfetto)" in md
    loss = [r for r in records if r["kind"] == "loss"]  # the loss benchmark: fused, compiled, reference
    assert len(loss) == 1 and loss[0]["returncode"] == 0 and "compiled" in loss[0]["output"]
    assert loss[0]["output"].strip() in md


def test_bench_host_times_the_host_side_of_the_graph_step(tmp_path):
    """benchmarks/bench_host.py runs the CUDA-graph step's host side on a CPU, its graphs stubbed out, and prints
    the host's time a step split into the data wait and the rest."""
    res = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[3] / "benchmarks" / "bench_host.py"),
                          "--steps", "5", "--workers", "0", "--profile", "3"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    head, split = res.stdout.splitlines()[:2]
    assert head.startswith("host: 2 + 2 layers, ") and "0 loader workers" in head and "5 steps (profiled)" in head
    step, data, rest = map(float, re.fullmatch(r" +([\d.]+) ms a step: waiting for data ([\d.]+), the rest ([\d.]+)",
                                               split).groups())
    assert 0 < rest and 0 <= data and step == pytest.approx(data + rest, abs=2e-3)
    assert "Ordered by: internal time" in res.stdout
