"""benchmarks/read_trace.py: the GPU's idle gaps in a bench.trace timeline, each put on the host operator that
launched the kernel after it, and a compiled kernel's source from torch.compile's logged code."""
import gzip
import json

import pytest

from tests.helpers.benchmarks import load_benchmark

read_trace = load_benchmark("read_trace")


def op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def launch(corr, ts, name="cudaLaunchKernel", tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def kernel(name, corr, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": 7}}


# A host-bound stretch: the GPU runs dry at 20 and waits for a launch made at 50 (a host gap of 40 µs); a kernel
# queued early but behind others (a queue gap); a CUDA graph replay launched late (its first kernel's gap is the
# host's, the gap inside the graph is not); a copy no launch matches.
EVENTS = [
    op("aten::linear", 0, 100), launch(1, 10), launch(2, 50), launch(3, 55),
    op("aten::linear", 1, 3, tid=2),  # another thread's operator, open at launch 1's time: not its launcher
    op("replay", 128, 5), launch(4, 130, "cudaGraphLaunch"),
    kernel("gemm", 1, 12, 8), kernel("gemm", 2, 60, 10), kernel("add", 3, 75, 5),
    kernel("graph_a", 4, 140, 10), kernel("graph_b", 4, 152, 8),
    kernel("Memcpy HtoD", 5, 161, 1, cat="gpu_memcpy"),
    {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "ts": 5},  # not a complete event: ignored
]


def test_gaps_are_put_on_the_operator_that_launched_the_next_kernel():
    r = read_trace.gaps([e for e in EVENTS if e["ph"] == "X"])
    assert r["window_us"] == 162 - 12 and r["busy_us"] == 8 + 10 + 5 + 10 + 8 + 1
    assert r["idle_us"] == pytest.approx(150 - 42)
    assert [(g["us"], g["kernel"], g["op"], g["host"]) for g in r["gaps"]] == [
        (40, "gemm", "aten::linear", True), (5, "add", "aten::linear", False),
        (60, "graph_a", "replay", True), (2, "graph_b", "replay", False)]  # the copy's 1 µs: under 2, not a gap
    assert r["host_idle_us"] == 100
    assert [g["us"] for g in read_trace.gaps(EVENTS, min_gap_us=5)["gaps"]] == [40, 5, 60]
    assert read_trace.gaps(EVENTS, min_gap_us=1)["gaps"][-1] == {"us": 1, "kernel": "Memcpy HtoD", "op": "(unmatched)",
                                                                 "host": False}


def test_report_and_the_command_line(tmp_path, capsys):
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": EVENTS}).encode()))
    assert read_trace.main([str(path), "--gaps", "2"]) == 0
    out = capsys.readouterr().out
    assert "device window 0.15 ms: busy 0.04 ms (28.0%), idle 0.11 ms, of which 0.10 ms waiting for a launch" in out
    assert "0.062 ms   41.3%  replay" in out and "0.045 ms   30.0%  aten::linear" in out
    assert "     60.0  host   graph_a  <- replay" in out and "gemm" in out and "graph_b" not in out  # top 2 gaps
    assert read_trace.main([str(path), "--kernels", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "kernel time: 0.021 ms a step over 2 step(s); the 2 largest:" in out  # 42 µs of kernels and copies
    assert "     0.009  42.9%        1.0       9.0  gemm" in out
    assert "     0.005  23.8%        0.5      10.0  graph_a" in out
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": [op("aten::mm", 0, 5)]}))
    assert read_trace.main([str(cpu)]) == 0
    assert "no GPU activity" in capsys.readouterr().out


LOG = "V1129 06:48:38.799000 27528 torch/_inductor/graph.py:2722] [0/0] [__output_code] "
CODE = "\n".join(LOG + line for line in [
    "async_compile = AsyncCompile()",
    "",
    "# kernel path: /tmp/torchinductor_root/ab/cab.py",
    "# Original ATen: [aten.native_dropout_backward, aten.native_layer_norm_backward]",
    "triton_per_fused_native_layer_norm_backward_6 = async_compile.triton("
    "'triton_per_fused_native_layer_norm_backward_6', '''",
    "import triton",
    "@triton.jit",
    "def triton_per_fused_native_layer_norm_backward_6(in_ptr0, xnumel, r0_numel):",
    "    xoffset = tl.program_id(0) * XBLOCK",
    "''', device_str='cuda')",
    "cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r'''",
    'extern "C" void kernel(float* out_ptr0)',
    "''')",
])


def test_kernel_source_from_the_logged_output_code(tmp_path, capsys):
    source = read_trace.kernel_source(CODE, "triton_per_fused_native_layer_norm_backward_6")
    assert source.splitlines() == [
        "# kernel path: /tmp/torchinductor_root/ab/cab.py",
        "# Original ATen: [aten.native_dropout_backward, aten.native_layer_norm_backward]",
        "import triton", "@triton.jit", "def triton_per_fused_native_layer_norm_backward_6(in_ptr0, xnumel, r0_numel):",
        "    xoffset = tl.program_id(0) * XBLOCK"]
    assert read_trace.kernel_source(CODE, "cpp_fused_add_0") == 'extern "C" void kernel(float* out_ptr0)'
    assert read_trace.kernel_source(CODE, "triton_per_fused_native_layer_norm_backward") is None  # whole names only
    code = tmp_path / "code.txt"
    code.write_text(CODE)
    assert read_trace.main(["--code", str(code), "--kernel", "cpp_fused_add_0"]) == 0
    assert capsys.readouterr().out.strip() == 'extern "C" void kernel(float* out_ptr0)'
    assert read_trace.main(["--code", str(code), "--kernel", "nope"]) == 2
    assert capsys.readouterr().err.strip() == f"error: no kernel named nope in {code}"
    packed = tmp_path / "code.txt.gz"  # as make bench-gpu keeps it
    packed.write_bytes(gzip.compress(CODE.encode()))
    assert read_trace.main(["--code", str(packed), "--kernel", "cpp_fused_add_0"]) == 0
    assert capsys.readouterr().out.strip() == 'extern "C" void kernel(float* out_ptr0)'
