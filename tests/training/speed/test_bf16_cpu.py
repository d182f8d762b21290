"""The bf16 CPU step (issue 75): the measured matrix-multiply peak, fp32 attention inside bf16 autocast, and
trainer.precision=auto chosen by a probe of one layer."""
import pytest
import torch
import torch.nn.functional as F

from transformer.model import Transformer
from transformer.model.layers import MultiHeadAttention
from transformer.training.speed import cpu_precision
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


@pytest.mark.parametrize("times, expected", [((10.0, 6.0), torch.bfloat16), ((6.0, 10.0), None),
                                             ((10.0, 9.0), None)])  # bf16 only 1.1x faster: not worth it
def test_auto_on_a_cpu_with_bf16_units_picks_the_faster_and_says_why(monkeypatch, caplog, times, expected):
    from transformer import dist
    from transformer.training.distributed import parallelize

    model = Transformer.from_config(_tiny(), 30, 20, False)
    monkeypatch.setattr(cpu_precision, "probe", lambda m, tokens: times)
    env = dist.DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with caplog.at_level("INFO"):
        assert parallelize.auto_on_cpu(model, 512, env) is expected
    line = next(r.getMessage() for r in caplog.records if "trainer.precision=auto" in r.getMessage())
    assert line.startswith(f"trainer.precision=auto: {'bf16' if expected else 'fp32'} (")
    assert all(f"{t:.1f} ms" in line for t in times)


def test_probe_times_both_precisions_and_leaves_the_model_and_rng_alone():
    model = Transformer.from_config(_tiny(), 30, 20, False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    fp32_ms, bf16_ms = cpu_precision.probe(model, 64, rounds=1, length=8)
    assert fp32_ms > 0 and bf16_ms > 0
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("saved, expected", [("bfloat16", torch.bfloat16), ("None", None)])
def test_a_resumed_auto_run_keeps_its_checkpoints_precision(tmp_path, saved, expected):
    """precision=auto's probe could answer otherwise on a resume: the checkpoint's dtype wins, said in a line;
    an explicit precision is left as given."""
    from tests.training.loop.test_trainer import make_trainer

    trainer = make_trainer(tmp_path)  # auto, resolved to fp32 here (tests/conftest.py)
    ckpt = trainer.state_dict()
    assert ckpt["trainer"]["amp_dtype"] == "None"
    ckpt["trainer"]["amp_dtype"] = saved
    resumed = make_trainer(tmp_path)
    resumed.load_state_dict(ckpt)
    assert resumed.amp_dtype is expected and resumed.parallel.amp_dtype is expected
    explicit = make_trainer(tmp_path, "trainer.precision=fp32")
    explicit.load_state_dict(ckpt)
    assert explicit.amp_dtype is None


def test_autos_answer_is_remembered_per_cpu_and_shape(monkeypatch, tmp_path):
    """A close race between the precisions must not flip between two runs of one command: the first probe's
    times are kept (by CPU model, torch, layer shape and batch size) and the next run reads them."""
    model = Transformer.from_config(_tiny(), 30, 20, False)
    probes = []

    def probe(m, tokens):
        probes.append(tokens)
        return (10.0, 6.0) if len(probes) == 1 else (6.0, 10.0)  # a second probe would answer the other way

    monkeypatch.setattr(cpu_precision, "probe", probe)
    cache = tmp_path / "cpu_precision.json"
    first, why = cpu_precision.choose(model, 512, cache)
    again, why_again = cpu_precision.choose(model, 512, cache)
    assert first is again is torch.bfloat16 and probes == [512]
    assert "remembered in" in why_again and "remembered" not in why
    assert cpu_precision.choose(model, 1024, cache)[0] is None and probes == [512, 1024]  # another batch size
    cache.write_text("not json")  # a damaged file: probed again, not an error
    assert cpu_precision.choose(model, 512, cache)[0] is None and len(probes) == 3
