"""trainer.precision=fp8 (transformer/experimental/fp8.py): refused in one line where it cannot run (a CPU, a GPU
before sm_89, ROCm, no torchao), checked before the run directory exists; on a CPU, the conversion itself
(torchao builds and runs its float8 layers there): which layers it takes, and checkpoints that stay plain.
On a GPU of sm_89 or newer, a short fp8 training run against bf16."""
import functools
import importlib.util
import sys

import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.models import one_thread  # noqa: F401 (autouse fixture)
from tests.helpers.numerics import close_scaled
from tests.test_contract import assert_one_error_line, run_train, tree_digest
from transformer.cli import train as train_cli
from transformer.config import ConfigError, ModelConfig
from transformer.dist import DistEnv
from transformer.experimental import fp8
from transformer.model import Transformer
from transformer.model.transformer import Generator
from transformer.training.distributed.parallelize import parallelize

# The dev extra installs torchao, so CI runs these; a checkout without it skips them and says why.
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")


def small_model(d_ff: int = 128, seed: int = 0, N: int = 2) -> Transformer:
    torch.manual_seed(seed)
    return Transformer.from_config(ModelConfig(N=N, d_model=64, d_ff=d_ff, h=4, dropout=0.0), 40, 40, True)


def fake_gpu(monkeypatch, capability, name="NVIDIA Fake GPU"):
    """torch sees one CUDA GPU of `capability` (nothing else of CUDA is touched by the checks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "hip", None)


def train_main(monkeypatch, tmp_path, capsys, *overrides) -> tuple:
    """transformer-train in this process (so the fakes hold): its exit code and stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["transformer-train", "experiment=copy", *overrides])
    with pytest.raises(SystemExit) as end:
        train_cli.main()
    return end.value.code, capsys.readouterr().err


# ---- refusals -----------------------------------------------------------------------------------------------

def test_fp8_on_a_cpu_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    before = tree_digest(tmp_path)
    r = run_train(tmp_path, "experiment=copy", "trainer.precision=fp8", "trainer.accelerator=cpu")
    assert r.returncode == 2, r.stderr
    assert_one_error_line(r.stderr, "trainer.precision=fp8", "on the CPU", "compute capability >= 8.9",
                          "trainer.precision=bf16")
    assert tree_digest(tmp_path) == before


def test_fp8_on_a_gpu_before_sm89_is_refused_before_the_run_directory(monkeypatch, tmp_path, capsys):
    fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    code, err = train_main(monkeypatch, tmp_path, capsys, "trainer.precision=fp8")
    assert code == 2, err
    assert_one_error_line(err, "trainer.precision=fp8", ">= 8.9", "NVIDIA A100-SXM4-80GB", "sm_80")
    assert list(tmp_path.iterdir()) == []


def test_fp8_without_torchao_names_the_extra(monkeypatch, tmp_path, capsys):
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    for name in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if it were not installed
    code, err = train_main(monkeypatch, tmp_path, capsys, "trainer.precision=fp8")
    assert code == 2, err
    assert_one_error_line(err, "trainer.precision=fp8", "torchao", "pip install -e '.[fp8]'")
    assert list(tmp_path.iterdir()) == []


def test_fp8_on_rocm_is_refused(monkeypatch):
    fake_gpu(monkeypatch, (9, 4), "AMD Instinct MI300X")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(ConfigError, match="NVIDIA GPUs only"):
        fp8.check(compose_cfg("trainer.precision=fp8").trainer)


@needs_torchao
@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_is_accepted_from_sm89_with_torchao(monkeypatch, capability):
    fake_gpu(monkeypatch, capability)
    fp8.check(compose_cfg("trainer.precision=fp8").trainer)
    assert fp8.refusal(torch.device("cuda", 0)) is None


def test_other_precisions_never_ask_the_device(monkeypatch):
    monkeypatch.setattr(fp8, "refusal", lambda device: pytest.fail("asked"))
    for precision in ("auto", "fp32", "bf16", "fp16"):
        fp8.check(compose_cfg(f"trainer.precision={precision}").trainer)


def test_parallelize_refuses_fp8_on_a_cpu_too():
    """transformer-bench (and any caller) reaches parallelize without the CLI's check: same line there."""
    cfg = compose_cfg("experiment=copy", "trainer.precision=fp8")
    model = small_model()
    with pytest.raises(ConfigError, match=r"trainer.precision=fp8 needs an NVIDIA GPU"):
        parallelize(model, cfg, DistEnv(device=torch.device("cpu")))
    assert not any(getattr(m, "float8", None) for m in model.modules())


# ---- the conversion, on a CPU -------------------------------------------------------------------------------

@needs_torchao
def test_convert_takes_every_linear_but_the_generator_and_keeps_the_state_dict():
    model = small_model()
    before = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in model.state_dict().items()}
    names = fp8.convert(model, emulate=True)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"qkv_proj", "out_proj", "q_proj", "w1", "w2", "memory_kv_proj"}
    assert len(names) == 2 * 4 + 2 * 6 + 1  # encoder layers 4 products, decoder layers 6, the memory projection
    assert type(model.generator) is Generator and model.generator.weight is model.tgt_embed.tokens.weight
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {n for n in names if not n.endswith(("qkv_proj", "memory_kv_proj"))}
    assert all(model.get_submodule(n).float8 is not None for n in names if n.endswith(("qkv_proj", "memory_kv_proj")))
    # the same Parameters: names, dtypes, shapes and storage unchanged
    assert {k: (v.dtype, v.shape, v.data_ptr()) for k, v in model.state_dict().items()} == before


@needs_torchao
def test_convert_keeps_out_products_whose_dims_are_not_multiples_of_16():
    model = small_model(d_ff=72)
    names = fp8.convert(model, emulate=True)
    assert not any(n.endswith((".w1", ".w2")) for n in names)
    assert all(type(layer.ff.w1) is torch.nn.Linear for layer in [*model.encoder, *model.decoder])
    assert any(n.endswith("out_proj") for n in names)


@needs_torchao
def test_fp8_products_are_close_to_the_plain_ones_and_train_every_parameter():
    plain, model = small_model(), small_model()
    fp8.convert(model, emulate=True)
    src, tgt = torch.randint(4, 40, (3, 9)), torch.randint(4, 40, (3, 7))
    y, ref = model(src, tgt), plain(src, tgt)  # (B, T, V)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.2, rel  # float8 rounding (3 mantissa bits): near, never equal
    y.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@needs_torchao
def test_fp8_products_take_batches_whose_token_count_is_no_multiple_of_16(monkeypatch):
    """The real float8 path (not emulation) with a CPU stand-in for the GPU kernel that refuses, as
    torch._scaled_mm does, an inner dimension that is not a multiple of 16. The weight gradient's inner dimension
    is the token count: 2 x 7 = 14 here. Zero padding changes no sum: the gradients equal emulation's."""
    ops = importlib.import_module("torchao.float8.float8_ops")
    shapes = []

    def scaled_mm(a, a_scale, b, b_scale, output_dtype, output_scale=None, bias=None, use_fast_accum=False):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        out = (a.float() / a_scale) @ (b.float() / b_scale)
        return (out if bias is None else out + bias).to(output_dtype)

    monkeypatch.setattr(ops, "addmm_float8_unwrapped", scaled_mm)
    src, tgt = torch.randint(4, 40, (2, 9)), torch.randint(4, 40, (2, 7))  # (B, S), (B, T): 18 and 14 tokens
    grads = []
    for emulate in (False, True):
        model = small_model()
        fp8.convert(model, emulate=emulate)
        model(src, tgt).logsumexp(-1).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert {a[1] for a, _ in shapes} >= {16, 32}, shapes  # weight gradients: 14 and 18 tokens, padded
    assert all(close_scaled(g, e, 128) for g, e in zip(*grads, strict=True))  # d_ff: the longest sum


@needs_torchao
def test_the_converted_model_compiles_in_one_graph():
    """trainer.compile over fp8 (the way its casts get fused on a GPU): Dynamo traces the Float8Linears and the
    stacked projections' float8 products without a graph break (aot_eager: the CPU has no float8 kernels)."""
    from torch._dynamo.utils import counters

    model = small_model(N=1)  # a layer of each kind holds every float8 product; Dynamo traces each layer anew
    fp8.convert(model, emulate=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    src, tgt = torch.randint(4, 40, (3, 9)), torch.randint(4, 40, (3, 7))
    y = compiled(src, tgt)
    y.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert close_scaled(y, model(src, tgt), 128)  # d_ff: the longest sum
    torch._dynamo.reset()


@needs_torchao
def test_a_float8_checkpoint_loads_into_a_plain_model_and_back():
    model = small_model(seed=1)
    fp8.convert(model, emulate=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    src, tgt = torch.randint(4, 40, (3, 9)), torch.randint(4, 40, (3, 7))
    model(src, tgt).logsumexp(-1).sum().backward()
    opt.step()  # weights a float8 run trained
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    plain = small_model(seed=2)
    plain.load_state_dict(saved, strict=True)
    assert all(torch.equal(v, saved[k]) and v.dtype == saved[k].dtype for k, v in plain.state_dict().items())
    back = small_model(seed=3)
    fp8.convert(back, emulate=True)
    back.load_state_dict(plain.state_dict(), strict=True)
    assert all(torch.equal(v, saved[k]) for k, v in back.state_dict().items())
    assert torch.equal(back(src, tgt), model(src, tgt))  # the stacked products read the loaded weight too


@needs_torchao
def test_a_float8_trainer_checkpoint_resumes_a_plain_trainer_and_back(tmp_path, monkeypatch):
    """The trainer's whole checkpoint (weights, Adam's state) moves between an fp8 and an fp32 run. The CPU
    refusal is lifted here only, and torchao emulates the float8 products."""
    from tests.training.loop.test_trainer import make_trainer
    from transformer.training.components.checkpoint import atomic_save, load_checkpoint

    monkeypatch.setattr(fp8, "refusal", lambda device: None)
    monkeypatch.setattr(fp8, "convert", functools.partial(fp8.convert, emulate=True))
    f8 = make_trainer(tmp_path / "fp8", "trainer.precision=fp8", "model.dropout=0.0")
    assert any(type(m).__name__ == "Float8Linear" for m in f8.model.modules())
    batches = list(f8.data.train_loader(0))
    for b in batches[:3]:
        f8._optimizer_step([b])
        f8.step += 1
    atomic_save(f8.state_dict(), tmp_path / "fp8.pt")
    plain = make_trainer(tmp_path / "fp32", "model.dropout=0.0", seed_model=5)
    plain.load_state_dict(load_checkpoint(tmp_path / "fp8.pt"), str(tmp_path / "fp8.pt"))
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), f8.model.parameters(), strict=True))
    plain._optimizer_step([batches[3]])
    atomic_save(plain.state_dict(), tmp_path / "fp32.pt")
    again = make_trainer(tmp_path / "fp8-again", "trainer.precision=fp8", "model.dropout=0.0", seed_model=6)
    again.load_state_dict(load_checkpoint(tmp_path / "fp32.pt"), str(tmp_path / "fp32.pt"))
    assert again.step == 3
    assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), plain.model.parameters(), strict=True))


# ---- on a GPU of sm_89 or newer -----------------------------------------------------------------------------

def sm89_or_skip() -> None:
    why = fp8.refusal(torch.device("cuda", 0))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
def test_fp8_trainer_on_gpu_learns(tmp_path):
    """The whole path: parallelize converts, the Trainer's steps (bf16 autocast around float8 products) learn."""
    sm89_or_skip()
    from tests.tiers.test_gpu import batches, loss_curve, make_trainer

    t = make_trainer(tmp_path, "fp8")
    # encoder layers: out_proj, w1, w2; decoder layers also q_proj and the cross-attention out_proj
    assert sum(type(m).__name__ == "Float8Linear" for m in t.model.modules()) == 2 * 3 + 2 * 5
    assert t.model.memory_kv_proj.float8 is not None
    curve = loss_curve(t, batches(t, 60))
    assert curve[-10:].mean() < curve[:10].mean() and all(curve == curve), curve


@pytest.mark.gpu
def test_fp8_loss_curve_on_gpu_stays_close_to_bf16():
    """benchmarks/loss_curves.py on the GPU: the same seed, batches and dropout draws in bf16 and fp8. Emulated
    float8 against fp32 on a CPU keeps the smoothed curves well within the bound asserted here."""
    sm89_or_skip()
    from benchmarks.loss_curves import compare, train

    r = compare({"fp8": train("fp8", 300, 1234, device="cuda")}, train("bf16", 300, 1234, device="cuda"), 20)["fp8"]
    assert r["mean_rel_gap"] < 0.03 and r["first_apart"] is not None, r


# ---- benchmarks/loss_curves.py's fp8 variant ----------------------------------------------------------------

def test_loss_curves_skips_fp8_on_a_cpu_and_says_why(capsys):
    from benchmarks.loss_curves import main

    assert main(["--variants", "fp32,fp8", "--steps", "3", "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "fp8            skipped: trainer.precision=fp8 needs an NVIDIA GPU" in out
    gaps = [ln.split()[0] for ln in out.splitlines() if "mean gap" in ln]
    assert gaps == ["fp32"], out


@needs_torchao
def test_loss_curves_fp8_variant_trains_the_converted_model(monkeypatch):
    """With torchao emulating the products (the CPU has no float8 units), the variant's curve is its own: near
    fp32's, never equal to it."""
    from benchmarks.loss_curves import train

    monkeypatch.setattr(fp8, "convert", functools.partial(fp8.convert, emulate=True))
    f8, ref = train("fp8", 4, 1234, dropout=0.0), train("bf16", 4, 1234, dropout=0.0)
    assert f8 != ref and all(abs(a - b) / b < 0.1 for a, b in zip(f8, ref, strict=True)), (f8, ref)


@needs_torchao
@pytest.mark.slow
def test_emulated_fp8_keeps_the_fp32_loss_curve_on_a_cpu(monkeypatch):
    """300 steps of model=tiny on the copy task (benchmarks/loss_curves.py): float8 products emulated by torchao
    against fp32, the smoothed curves within 2% on average (the issue's bar for the switches that keep the
    mathematics; float8 rounds, so only near)."""
    from benchmarks.loss_curves import compare, train

    monkeypatch.setattr(fp8, "convert", functools.partial(fp8.convert, emulate=True))
    r = compare({"fp8": train("fp8", 300, 1234)}, train("fp32", 300, 1234), 20)["fp8"]
    assert r["mean_rel_gap"] < 0.02 and r["first_apart"] is not None, r
