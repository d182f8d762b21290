"""The bf16 CPU step (issue 75): the measured matrix-multiply peak, fp32 attention inside bf16 autocast, and
trainer.precision=auto as the hardware rule."""
import pytest
import torch
import torch.nn.functional as F

from transformer.model import Transformer
from transformer.model.layers import MultiHeadAttention
from transformer.training.tools import peak


def test_mm_peak_is_the_best_shape_and_a_plausible_rate(monkeypatch):
    shapes = peak.model_shapes(64, 16, 32, 50)
    assert shapes == [(64, 16, 32), (64, 32, 16), (64, 16, 48), (64, 16, 50)]
    rate = peak.mm_tflops((64, 16, 32), torch.float32, seconds=0.01)
    assert 1e-6 < rate < 1e3  # a real measurement: TFLOP/s of a CPU, not seconds or FLOP/s
    monkeypatch.setattr(peak, "mm_tflops", lambda shape, dtype, seconds: shape[2] / 100)
    assert peak.mm_peak_tflops(shapes, torch.float32) == 0.5  # the highest of the shapes


@pytest.mark.parametrize("compute, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_cpu_peak_multiplies_in_the_compute_dtype(monkeypatch, compute, dtype):
    seen = []
    monkeypatch.setattr(peak, "mm_tflops", lambda shape, d, seconds: seen.append((shape, d)) or 1.0)
    args = Transformer.from_config(_tiny(), 30, 20, False).args
    assert peak.cpu_peak_tflops(args, 128, compute) == 1.0
    assert {d for _, d in seen} == {dtype} and (128, args.d_model, args.d_ff) in [s for s, _ in seen]


def test_bf16_attention_on_a_cpu_runs_in_fp32_and_returns_bf16():
    """Equal to fp32 SDPA on the same bf16 inputs, rounded once; gradients reach q, k and v in bf16."""
    torch.manual_seed(0)
    att = MultiHeadAttention(16, 2, 0.0)
    q, k, v = (torch.randn(3, 2, 5, 8).bfloat16().requires_grad_(True) for _ in range(3))
    bias = torch.zeros(3, 1, 1, 5, dtype=torch.bfloat16)
    bias[0, ..., 3:] = float("-inf")
    for mask, causal in ((bias, False), (None, True)):
        out = att._attend(q, k, v, mask, causal, 0.0)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             attn_mask=None if mask is None else mask.float(), is_causal=causal)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
        out.float().sum().backward()
        assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


def _tiny():
    from tests.helpers.cli import compose_cfg
    return compose_cfg("model=tiny").model


@pytest.mark.parametrize("units", [True, False])
def test_auto_on_a_cpu_follows_its_bf16_units_and_says_so(monkeypatch, caplog, units):
    """A rule, not a timing: the same on every run of one command on one machine, with the start line's reason."""
    from tests.helpers.cli import compose_cfg
    from transformer import dist
    from transformer.training.distributed import parallelize
    from transformer.training.speed import speedups

    monkeypatch.setattr(speedups, "native_bf16_cpu", lambda: units)
    cfg = compose_cfg("model=tiny")
    env = dist.DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with caplog.at_level("INFO"):
        out = parallelize.parallelize(Transformer.from_config(cfg.model, 30, 20, False), cfg, env)
    assert out.amp_dtype is (torch.bfloat16 if units else None)
    line = next(r.getMessage() for r in caplog.records if "trainer.precision=auto" in r.getMessage())
    assert line.startswith(f"trainer.precision=auto: {'bf16' if units else 'fp32'} (this CPU ")
