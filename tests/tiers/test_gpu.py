"""GPU tier (skipped where torch sees no CUDA device; `make bench-gpu` runs it): bf16 autocast, fused
kernels, NCCL, a training step with no host sync between logged lines, compile and precision agreement,
exact resume in deterministic mode, and translation equal on GPU and CPU."""
import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.helpers.cli import cli_env, compose_cfg, train_cmd
from tests.helpers.dist import assert_same_state, last_ckpt, run_cli, train
from transformer.data.copy import CopyData
from transformer.dist import DistEnv
from transformer.model import Transformer
from transformer.tasks import build_task
from transformer.training.distributed.parallelize import autocast_dtype, parallelize
from transformer.training.loop.hotpath import LaggedFlag, TrainWindow
from transformer.training.loop.trainer import Trainer
from transformer.training.speed.speedups import native_bf16_tf32
from transformer.training.tools.profiling import host_syncs

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
GPU = ("trainer.accelerator=gpu",)


def make_trainer(tmp_path, precision, *overrides, env=None):
    cfg = compose_cfg("experiment=copy", "model.N=2", "data.copy.train_size=512", "data.copy.val_size=64",
                      f"trainer.precision={precision}", "trainer.progress=false", *overrides)
    data = CopyData(cfg, cfg.seed, 0, 1)
    torch.manual_seed(0)
    model = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
    env = env or DistEnv(device=CUDA)
    return Trainer(cfg, env, parallelize(model, cfg, env), data, build_task(cfg), tmp_path)


def batches(t, n):
    """n training batches over as many epochs as it takes, pinned as the GPU loaders of real data pin them
    (a copy from pageable memory would make the step wait for the GPU)."""
    out = []
    for epoch in range(1000):
        out += [b.pin_memory() for b in t.data.train_loader(epoch)]
        if len(out) >= n:
            return out[:n]


def loss_curve(t, bs, accumulate=1):
    window, flag = TrainWindow(), LaggedFlag()
    results = [t._train_step(bs[i:i + accumulate], window, flag)[0] for i in range(0, len(bs), accumulate)]
    return np.array([(r.loss / r.tokens).item() for r in results])


def test_a_cuda_trace_puts_the_host_gap_on_the_operator_after_it(tmp_path):
    """benchmarks/read_trace.py on a real CUDA timeline, as bench.trace writes it (its tests elsewhere use a
    synthetic one): kernels found and matched to the operators that launched them, and a gap the host makes
    by sleeping between two launches counted as the host's."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from tests.helpers.benchmarks import load_benchmark
    from transformer.training.tools.profiling import write_trace

    read_trace = load_benchmark("read_trace")
    x = torch.randn(1024, 1024, device=CUDA)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        y = x @ x
        torch.cuda.synchronize()
        time.sleep(0.01)  # the GPU has nothing to run for 10 ms
        y.relu()
        torch.cuda.synchronize()
    write_trace(prof, tmp_path / "t.json.gz")
    r = read_trace.gaps(read_trace.load(tmp_path / "t.json.gz"))
    longest = max(r["gaps"], key=lambda g: g["us"])
    assert r["busy_us"] > 0 and longest["us"] >= 9000 and longest["host"] and r["host_idle_us"] >= longest["us"]
    assert longest["op"].startswith("aten::"), longest  # the relu's own operator, found by correlation id


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_training_steps_on_gpu_reduce_the_loss(tmp_path, precision):
    t = make_trainer(tmp_path, precision)
    curve = loss_curve(t, batches(t, 30))
    assert curve[-5:].mean() < curve[:5].mean()
    assert all(p.is_cuda for p in t.model.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_no_host_sync_between_logged_lines(tmp_path, precision):
    t = make_trainer(tmp_path, precision, "trainer.clip_norm=1.0", "trainer.accumulate=2")
    bs = batches(t, 16)
    window, flag = TrainWindow(), LaggedFlag()
    for i in (0, 2):  # warm-up: Adam's state, cuBLAS handles, the flag's pinned buffers
        t._train_step(bs[i:i + 2], window, flag)
    syncs = host_syncs(lambda: [t._train_step(bs[i:i + 2], window, flag) for i in range(4, 16, 2)])
    assert syncs == [], syncs
    assert host_syncs(lambda: t._log_train(window, None))  # the logged line does read: the counter works


@dataclass(frozen=True)
class OneRankDDP(DistEnv):
    """World size 1 taking the distributed code path: DDP, no_sync, NCCL all-reduce."""

    @property
    def distributed(self) -> bool:
        return True


def test_nccl_single_process_ddp_equals_plain_and_never_syncs(tmp_path):
    torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1,
                                         device_id=CUDA)
    try:
        common = ("model.dropout=0.0", "trainer.tf32=false", "trainer.accumulate=2", "trainer.clip_norm=1.0")
        ddp = make_trainer(tmp_path / "ddp", "fp32", *common, env=OneRankDDP(device=CUDA))
        plain = make_trainer(tmp_path / "plain", "fp32", *common)
        assert isinstance(ddp.net, torch.nn.parallel.DistributedDataParallel)
        bs = batches(plain, 12)
        curve_plain = loss_curve(plain, bs, accumulate=2)
        curve_ddp = loss_curve(ddp, bs[:4], accumulate=2)  # warm-up (DDP rebuilds its buckets after step 1)
        window, flag = TrainWindow(), LaggedFlag()
        syncs = host_syncs(lambda: [ddp._train_step(bs[i:i + 2], window, flag) for i in range(4, 12, 2)])
        assert syncs == [], syncs
        np.testing.assert_allclose(curve_ddp, curve_plain[:2], rtol=1e-5)
        for a, b in zip(ddp.model.parameters(), plain.model.parameters(), strict=False):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    finally:
        torch.distributed.destroy_process_group()


def test_bf16_and_fp32_loss_curves_agree(tmp_path):
    curves = {}
    for precision in ("fp32", "bf16"):
        t = make_trainer(tmp_path / precision, precision, "model.dropout=0.0", "trainer.tf32=false")
        curves[precision] = loss_curve(t, batches(t, 40))
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert fp32[-5:].mean() < 0.95 * fp32[:5].mean()  # it trains, so the curves have a shape to agree on
    assert np.abs(bf16 - fp32).max() < 0.03 * fp32.mean(), (fp32, bf16)


def test_translate_on_gpu_equals_cpu_greedy(tmp_path):
    run = tmp_path / "run"
    run_cli(train_cmd("experiment=copy", *GPU, f"hydra.run.dir={run}", "trainer.progress=false"), tmp_path)
    rng = np.random.default_rng(0)
    src = tmp_path / "src.txt"
    src.write_text("".join(" ".join(map(str, rng.integers(4, 11, 10))) + "\n" for _ in range(200)))
    outs = {}
    for device in ("cpu", "cuda"):
        res = subprocess.run([sys.executable, "-m", "transformer.cli.translate", str(run / "checkpoints" / "best.pt"),
                              "--input", str(src), "--beam", "1", "--device", device], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[device] = res.stdout.splitlines()
    assert outs["cuda"] == outs["cpu"]
    expected = src.read_text().splitlines()
    assert np.mean([o == s for o, s in zip(outs["cpu"], expected, strict=False)]) > 0.9  # a trained model


def test_bench_reports_mfu_on_gpu(tmp_path):
    res = subprocess.run([sys.executable, "-m", "transformer.cli.bench", "model=tiny", "bench.synthetic=true",
                          "bench.warmup=3", "bench.steps=10", "bench.repeats=2", "bench.profile_steps=2",
                          "trainer.progress=false", *GPU], cwd=tmp_path,
                         env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["device"].startswith(("NVIDIA", "Tesla")) and r["peak_mem_kind"] == "cuda_max_allocated"
    assert r["compute"] == ("bf16" if native_bf16_tf32(CUDA) else "fp32")
    assert r["forward_backward_ms"] > 0 and r["tgt_tokens_per_s"] > 0
    if r["peak_tflops"] is not None:
        assert 0 < r["mfu"] <= r["mfu_computed"] < 1
    # Batches come from the training default of 2 loader workers; the profile window saw kernels on the device.
    assert r["loader_workers"] == 2 and 0 < r["busy"] <= 1
    assert r["top_ops_kind"] == "kernels_self_device" and 1 <= len(r["top_ops"]) <= 15
    # The whole kernel account: kernels and the host's launch calls per step, every kernel's time in a family,
    # at least the top list's (the top list is part of it).
    account = r["kernel_account"]
    assert account["kernels"] >= len(r["top_ops"]) and account["launches"] > 0 and "matmul" in account["families"]
    assert account["kernel_ms"] == pytest.approx(sum(account["families"].values()))
    assert account["kernel_ms"] >= sum(t["self_ms"] for t in r["top_ops"]) * 0.99
    assert "kernels / step" in res.stdout and "by family" in res.stdout


def test_auto_precision_is_bf16_where_supported():
    expected = torch.bfloat16 if torch.cuda.get_device_capability(CUDA)[0] >= 8 else None  # not emulated bf16
    assert autocast_dtype("auto", CUDA) == expected
    assert autocast_dtype("auto", torch.device("cpu")) is None  # conftest: tests run as on a CPU without bf16 units


def test_flash_attention_kernel_runs_for_causal_self_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    assert torch.allclose(out.float(), ref, atol=2e-2)


def test_padding_bias_reaches_the_efficient_kernel_as_made():
    """The source padding mask (`layers.padding_bias`) goes to the memory-efficient kernel without SDPA's
    per-call conversion or alignment copy, and the outputs are bitwise those of the boolean mask."""
    from torch.profiler import ProfilerActivity, profile

    from tests.model.test_model import _bool_mask_forward
    from transformer.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=128, d_ff=256, h=2), 50, 50).to(CUDA).eval()
    src, tgt = torch.randint(4, 50, (6, 13), device=CUDA), torch.randint(4, 50, (6, 9), device=CUDA)
    src[0, 5:] = src[3, 11:] = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = model(src, tgt)
        ref = _bool_mask_forward(model, src, tgt)
    names = [e.key for e in prof.key_averages()]
    assert [n for n in names if "efficient_attention" in n], names
    assert not [n for n in names if n in ("aten::where", "aten::constant_pad_nd", "aten::scalar_tensor")], names
    assert torch.equal(out, ref)


def test_training_attention_avoids_cudnn_plans(tmp_path):
    """Every new batch shape costs cuDNN's SDPA a host-side plan (transformer/model/layers.py): the
    trainer's steps run flash or memory-efficient attention kernels instead."""
    from torch.profiler import ProfilerActivity, profile

    t = make_trainer(tmp_path, "bf16")
    bs = batches(t, 4)
    window, flag = TrainWindow(), LaggedFlag()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in bs:
            t._train_step([b], window, flag)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not [n for n in names if "cudnn_attention" in n], sorted(names)
    assert [n for n in names if "flash_attention" in n or "efficient_attention" in n], sorted(names)


def test_gpu_stats_report_memory_and_nvml_utilisation():
    from transformer.training.reporting.logs import gpu_stats

    x = torch.ones(1024, 1024, device="cuda")
    stats = gpu_stats(CUDA)
    assert stats["gpu_mem_gb"] >= x.numel() * 4 / 2**30
    assert 0 <= stats["gpu_util"] <= 100  # NVML answered for the GPU torch calls cuda:0


# ---- the slowest last: a tier its time budget cuts short still runs the short tests above --------------------
def test_compile_on_and_off_give_the_same_loss_curve(tmp_path):
    """Eager, the whole model compiled, and each layer compiled (trainer.compile_scope=layers)."""
    curves = {}
    for scope in ("eager", "model", "layers"):
        compiled = ("trainer.compile=true", f"trainer.compile_scope={scope}") if scope != "eager" else ()
        t = make_trainer(tmp_path / scope, "fp32", "model.dropout=0.0", "trainer.tf32=false", *compiled)
        curves[scope] = loss_curve(t, batches(t, 20))
    np.testing.assert_allclose(curves["model"], curves["eager"], rtol=5e-3)
    np.testing.assert_allclose(curves["layers"], curves["eager"], rtol=5e-3)


def test_exact_resume_on_gpu_in_deterministic_mode(tmp_path):
    """As tests/training/loop/test_resume.py on CPU: cut at step 4, resume, end bit-identical to the uninterrupted run,
    CUDA RNG state included (dropout on)."""
    opts = (*GPU, "trainer.deterministic=true", "model.dropout=0.1", "trainer.max_steps=9", "trainer.val_every=3",
            "checkpoint.every_steps=100")
    train(tmp_path / "ref", *opts, cwd=tmp_path)
    train(tmp_path / "cut", *opts, "trainer.max_steps=4", cwd=tmp_path)
    train(tmp_path / "cut", *opts, cwd=tmp_path)
    ref, resumed = last_ckpt(tmp_path / "ref"), last_ckpt(tmp_path / "cut")
    assert ref["trainer"]["step"] == 9
    assert_same_state(resumed, ref)
    assert torch.equal(resumed["rng"][0]["cuda"], ref["rng"][0]["cuda"])
