"""transformer-bench's parts without a run: the default step count, the output folders' checks, the commit, and
the report of a GPU record (kernels, CUDA graphs, an unknown peak) that no CPU run produces."""
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from transformer.config import ConfigError
from transformer.training.tools import bench
from transformer.training.tools.bench_report import table


def test_steps_default_to_20_on_a_cpu_and_100_on_a_gpu():
    unset = SimpleNamespace(steps=None)
    assert bench.timed_steps(unset, torch.device("cpu")) == 20
    assert bench.timed_steps(unset, torch.device("cuda", 0)) == 100
    assert bench.timed_steps(SimpleNamespace(steps=7), torch.device("cuda", 0)) == 7


def test_an_output_folder_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch):
    b = OmegaConf.create({"out": str(tmp_path / "runs" / "bench.jsonl"), "trace": None})
    bench.check_outputs(b)  # made, writable
    assert (tmp_path / "runs").is_dir()
    monkeypatch.setattr(bench.os, "access", lambda path, mode: False)  # root may write anywhere: pretend
    with pytest.raises(ConfigError, match=r"^bench.out='.*bench.jsonl': its folder .*runs is not writable"):
        bench.check_outputs(b)


def test_the_commit_is_unknown_where_git_cannot_run(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    assert bench._commit() is None
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")  # benchmarks/bench_gpu.py's copied tree
    assert bench._commit() == "abc1234"


def gpu_record(**changes) -> dict:
    """A record as a GPU run without a datasheet peak writes it (the keys `table` reads)."""
    r = {
        "device": "cuda", "workers": 1, "torch": "2.13.0", "commit": "abc1234", "params_m": 1.2, "compute": "bf16",
        "model": {"N": 2, "N_dec": 2, "d_model": 64, "d_ff": 128, "h": 4, "src_vocab_size": 500,
                  "tgt_vocab_size": 500},
        "compile": True, "data": "synthetic", "max_tokens": 600, "accumulate": 1, "mfu": None,
        "tgt_tokens_per_s": 1e5, "tgt_tokens_per_s_spread": {"median": 1e5, "min": 9e4, "max": 1.1e5},
        "repeats": 2, "steps": 3, "warmup_steps": 1, "warmup_s": 2.0, "loader_workers": 0,
        "src_tokens_per_s": 1e5, "sentences_per_s": 5e3, "target_padding": 0.1, "step_ms": 4.0,
        "data_wait_ms": 0.1, "forward_backward_ms": 3.0, "communication_ms": None, "optimizer_ms": 0.5,
        "other_ms": 0.4, "host_ms": {"forward_backward": 1.0}, "host_step_ms": 1.2, "peak_mem_gb": 1.5,
        "peak_mem_kind": "allocated", "flops_per_step": 1e11, "flops_computed_per_step": 1.2e11,
        "waste_padding": 0.1, "waste_pad_multiple": 0.02, "static_shapes": True, "shapes": 3,
        "pad_to_multiple": None, "achieved_tflops": 25.0, "flag_waits_per_step": 1.0, "host_syncs_per_step": 0.0,
        "kernel_account": {"kernels": 210, "kernel_ms": 3.5, "launches": 12, "families": {"gemm": 2.0}},
        "top_ops": None, "trace": None, "cuda_graphs_captured": 2, "cuda_graphs_captured_timed": 0,
        "graphs": 1, "graphs_during_timed": 0, "compile_cache": {"hits": 1, "misses": 0},
    }
    return {**r, **changes}


def test_a_gpu_record_reports_its_kernels_its_captures_and_an_unknown_peak():
    text = table(gpu_record())
    assert "n/a (no known peak: set bench.peak_tflops)" in text
    assert "210, 3.50 ms of device time (88% of the step), queued by 12 host launch calls" in text
    assert "gemm 2.00 ms" in text
    assert "2 micro-batch shapes (0 during the timed steps)" in text
    assert "n/a (one worker)" in text and "0.00 synchronising calls" in text
    cpu = table(gpu_record(device="cpu", kernel_account={"ops": 1234}, cuda_graphs_captured=None))
    assert "n/a on CPU" in cpu and "1,234 aten calls" in cpu and "CUDA graphs captured" not in cpu


@pytest.mark.parametrize("probes, busy", [([0.88, 0.86], False), ([0.108, 0.182], True)])
def test_a_cpu_record_shows_both_peak_probes_and_says_when_one_met_a_busy_machine(probes, busy):
    peak = max(probes)
    text = table(gpu_record(device="cpu", kernel_account={"ops": 1}, cuda_graphs_captured=None, mfu=0.2 / peak,
                            mfu_computed=0.21 / peak, mfu_spread={"median": 0.2 / peak, "min": 0.2 / peak,
                                                                  "max": 0.2 / peak},
                            peak_tflops=peak, peak_source="torch.mm bf16 at the model's shapes", peak_probes=probes))
    row = next(line for line in text.splitlines() if line.lstrip().startswith("peak probes"))
    assert " / ".join(f"{p:.4g}" for p in probes) + " TFLOP/s before / after the timed steps" in row
    assert ("the machine was busy" in row) is busy
    assert f"of {peak:.4g} TFLOP/s (torch.mm bf16" in text  # MFU divides by the higher probe
    assert "peak probes" not in table(gpu_record())  # a GPU's datasheet peak: nothing probed
