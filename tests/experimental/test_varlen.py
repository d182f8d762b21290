"""trainer.unpadded_attention (transformer/experimental/varlen.py): the packed model's outputs and gradients equal the
padded model's on a batch of varied lengths (P_drop 0), on the CPU reference path."""
import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.composed import small_trainer as make_trainer  # composed once a process
from tests.helpers.numerics import close_scaled
from transformer.config import ModelConfig
from transformer.data.batch import collate
from transformer.experimental.varlen import host_packing, pack, packing, unpack
from transformer.model import ModelOptions, Transformer
from transformer.specials import PAD
from transformer.training.components.loss import label_smoothed_cross_entropy


def varied_batch():
    g = torch.Generator().manual_seed(5)
    src, tgt = torch.randint(4, 30, (4, 9), generator=g), torch.randint(4, 30, (4, 7), generator=g)
    for row, (s, t) in enumerate([(9, 7), (3, 2), (6, 7), (1, 4)]):
        src[row, s:], tgt[row, t:] = PAD, PAD
    return src, tgt


def test_packing_round_trip():
    src, _ = varied_batch()
    p = packing(src != PAD)
    assert p.cu_seqlens.tolist() == [0, 9, 12, 18, 19] and p.max_len == 9
    x = torch.randn(4, 9, 5)
    back = unpack(pack(x, p), p)
    assert torch.equal(back[src != PAD], x[src != PAD]) and back[src == PAD].abs().sum() == 0


def padded_then_unpadded(norm_first: bool) -> list:
    """A training forward and backward of one model (P_drop 0) on varied_batch(), padded, then unpadded: for each,
    the real positions' logits, the loss and the gradients by parameter name."""
    cfg = ModelConfig(N=2, N_dec=3, d_model=32, d_ff=64, h=4, dropout=0.0, norm_first=norm_first)
    src, tgt = varied_batch()
    real = tgt != PAD
    results = []
    for on in (False, True):
        torch.manual_seed(0)  # the same weights
        model = Transformer.from_config(cfg, 30, 30, True, options=ModelOptions(unpadded_attention=on)).train()
        logits = model(src, tgt)  # (B, T, V)
        loss, _ = label_smoothed_cross_entropy(logits, torch.where(real, tgt, PAD), 0.1, PAD)
        loss.backward()
        results.append((logits[real].detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


@pytest.mark.parametrize("norm_first", [False, True])
def test_unpadded_equals_padded_outputs_and_gradients(norm_first):
    (a, la, ga), (b, lb, gb) = padded_then_unpadded(norm_first)
    n = 64  # the longest sums: d_ff's (a weight's gradient sums the 36 rows of the (4, 9) source)
    assert close_scaled(b, a, n) and close_scaled(lb, la, n)
    for name in ga:
        assert close_scaled(gb[name], ga[name], n), name


def test_trainer_switch(tmp_path):
    """The switch reaches the model; a run with it (and the bf16 stream) trains, validates and decodes."""
    t = make_trainer(tmp_path, "trainer.unpadded_attention=true", "trainer.bf16_residual=true",
                     "trainer.max_steps=3", "trainer.max_epochs=null", "trainer.val_every=3")
    assert t.model.unpadded_attention and t.train() == 0
    assert not make_trainer(tmp_path / "off").model.unpadded_attention


def test_commands_start_without_importing_the_compiler():
    """torch.nn.attention.varlen imports torch._dynamo, a large share of every command's start: the varlen
    kernels are imported when a model turns unpadded attention on, not with the package."""
    import subprocess
    import sys
    code = ("import sys, transformer.cli.train, transformer.cli.translate, transformer.cli.bench\n"
            "assert 'torch._dynamo' not in sys.modules, 'imported at start'\n"
            "from transformer.config import ModelConfig\n"
            "from transformer.model import Transformer\n"
            "from transformer.model import ModelOptions\n"
            "Transformer.from_config(ModelConfig(N=1, d_model=8, d_ff=16, h=2), 9, 9, True, "
            "options=ModelOptions(unpadded_attention=True))\n"
            "import importlib.util\n"  # torch < 2.10 has no varlen kernel: nothing to import then
            "name = 'torch.nn.attention.varlen'\n"
            "assert name in sys.modules or not importlib.util.find_spec(name)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("windowed", [True, False])
def test_torchs_varlen_kernel_is_called_as_its_release_expects(monkeypatch, windowed):
    """torch 2.10's varlen_attn takes is_causal; later releases (the lent GPU machines' 2.11) window_size."""
    import inspect

    kernels = pytest.importorskip("torch.nn.attention.varlen", reason="torch < 2.10 has no varlen kernel")
    varlen_attn = kernels.varlen_attn

    from transformer.experimental import varlen
    varlen.load_kernels()  # what a model built with ModelOptions(unpadded_attention=True) does
    assert varlen.torch_varlen_attn is varlen_attn
    assert varlen.WINDOWED == ("window_size" in inspect.signature(varlen_attn).parameters)  # this torch's
    calls = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(kwargs)
        return q
    monkeypatch.setattr(varlen, "torch_varlen_attn", fake)
    monkeypatch.setattr(varlen, "WINDOWED", windowed)
    p = varlen.Packing(torch.arange(3), torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3]), 3, 1, 3)
    q = torch.zeros(3, 2, 4)
    for causal in (True, False):
        assert varlen._torch_varlen(q, q, q, p, p, causal) is q
    assert calls == ([{"window_size": (-1, 0)}, {"window_size": (-1, -1)}] if windowed
                     else [{"is_causal": True}, {"is_causal": False}])


def test_float32_queries_take_the_reference_not_a_flash_kernel(monkeypatch):
    """Both varlen kernels are flash kernels, fp16 and bf16 only: under trainer.precision=fp32 on a GPU the
    reference runs (torch's kernel raises on float32 queries: docs/benchmarks/2026-11-gpu.md, "GPU: H200,
    2026-11-29")."""
    from types import SimpleNamespace

    from transformer.experimental import varlen
    torchs, flash = object(), object()
    monkeypatch.setattr(varlen, "torch_varlen_attn", torchs)
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", None)

    def kernel(dtype, dropout, cuda=True):
        return varlen.varlen_kernel(SimpleNamespace(is_cuda=cuda, dtype=dtype), dropout)
    assert kernel(torch.bfloat16, 0.0) is torchs and kernel(torch.float16, 0.0) is torchs
    assert kernel(torch.float32, 0.0) is None and kernel(torch.bfloat16, 0.1) is None  # torch's: no dropout
    assert kernel(torch.bfloat16, 0.0, cuda=False) is None
    monkeypatch.setattr(varlen, "flash_attn_varlen_func", flash)
    assert kernel(torch.bfloat16, 0.1) is flash and kernel(torch.float32, 0.1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_varlen_kernel_equals_padded(dropout):
    """On a GPU under bf16 autocast the packed model runs flash-attn's varlen kernel (where installed) or
    torch's varlen_attn (P_drop 0): outputs within bf16 rounding of the padded model's (in eval mode, so
    dropout is off in both), and a training step with dropout runs and gives finite gradients."""
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=dropout)
    src, tgt = (t.cuda() for t in varied_batch())
    real = tgt != PAD
    outs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for on in (False, True):
            torch.manual_seed(0)  # the same weights
            model = Transformer.from_config(cfg, 30, 30, True, options=ModelOptions(unpadded_attention=on))
            model.cuda().eval()
            outs.append(model(src, tgt)[real].float())
    assert (outs[0] - outs[1]).norm() / outs[0].norm() < 2e-2
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = label_smoothed_cross_entropy(model(src, tgt), tgt, 0.1, PAD)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
def test_attention_dropout_zero_trains_on_a_varlen_kernel(monkeypatch):
    """model.attention_dropout=0 with P_drop 0.1 elsewhere: a training forward runs every attention call on a
    varlen kernel (torch's has no dropout; flash-attn's where installed), never the re-padding reference."""
    from transformer.experimental import varlen

    calls = []
    real = varlen._reference
    monkeypatch.setattr(varlen, "_reference", lambda *a: calls.append("reference") or real(*a))
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=0.1, attention_dropout=0.0),
                                    30, 30, True, options=ModelOptions(unpadded_attention=True)).cuda().train()
    src, tgt = (t.cuda() for t in varied_batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = label_smoothed_cross_entropy(model(src, tgt), tgt, 0.1, PAD)
    loss.backward()
    assert calls == [] and all(torch.isfinite(p.grad).all() for p in model.parameters())


# ---- packings made on the host by the loader's collate: the same tensors, no host sync ------------------------

class SyncRecorder(TorchDispatchMode):
    """Records the aten calls that read a device value on the host (item(), int(t), bool(t), nonzero): on a GPU
    each is a host sync. On a CPU they are cheap but still counted, which is how these tests see them."""

    SYNCING = {"_local_scalar_dense", "nonzero", "is_nonzero", "item"}

    def __init__(self):
        super().__init__()
        self.calls = []  # (op name, the innermost frames of this project)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCING:
            frames = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                      if "/transformer/" in f.filename or "torch/optim" in f.filename]
            self.calls.append((func.overloadpacket.__name__, frames[-3:]))
        return func(*args, **(kwargs or {}))


def varied_items():
    src, tgt = varied_batch()
    pairs = zip(src, tgt, strict=True)
    return [(i, s[s != PAD][:-1].numpy(), t[t != PAD][1:].numpy()) for i, (s, t) in enumerate(pairs)]


def test_host_packing_equals_device_packing():
    rng = np.random.default_rng(0)
    for B, T in [(1, 1), (5, 7), (16, 40)]:
        lengths = rng.integers(1, T + 1, size=B)
        real = torch.arange(T)[None, :] < torch.from_numpy(lengths)[:, None]
        a, b = host_packing(lengths, T), packing(real)
        for name in ("index", "cu_seqlens", "lengths"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert (a.max_len, a.B, a.T) == (b.max_len, b.B, b.T)


def test_packing_fit_to_a_further_padded_batch():
    lengths = np.array([3, 1, 4])
    for B, T in [(3, 4), (3, 8), (5, 8), (4, 4)]:
        real = torch.zeros(B, T, dtype=torch.bool)
        real[:3, :4] = torch.arange(4)[None, :] < torch.from_numpy(lengths)[:, None]
        a, b = host_packing(lengths, 4).fit(B, T), packing(real)
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("index", "cu_seqlens", "lengths"))
        assert (a.max_len, a.B, a.T) == (b.max_len, B, T)
    with pytest.raises(ValueError, match="cannot describe"):
        host_packing(lengths, 4).fit(2, 4)


def test_collate_attaches_packings_only_when_asked():
    items = varied_items()
    plain, packed = collate(items), collate(items, packed=True)
    assert plain.packings is None
    for batch_side, p in zip((packed.src, packed.tgt_in), packed.packings, strict=True):
        q = packing(batch_side != PAD)
        assert torch.equal(p.index, q.index) and torch.equal(p.cu_seqlens, q.cu_seqlens) and p.max_len == q.max_len
    assert packed.to(torch.device("cpu")).packings is not None


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_host_packings_give_identical_outputs_and_gradients(dropout):
    """The forward with the loader's packings is the same computation as the one that packs on the device:
    bitwise equal logits and gradients (dropout included: packing draws no random numbers)."""
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, N_dec=2, d_model=32, d_ff=64, h=4, dropout=dropout)
    model = Transformer.from_config(cfg, 30, 30, True, options=ModelOptions(unpadded_attention=True)).train()
    batch = collate(varied_items(), packed=True)
    results = []
    for packings in (None, batch.packings):
        model.zero_grad()
        torch.manual_seed(1)
        logits = model(batch.src, batch.tgt_in, packings=packings)
        loss, _ = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.1, PAD)
        loss.backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("pad_to_multiple", [1, 8])
def test_training_step_reads_no_device_value(tmp_path, pad_to_multiple):
    """The trainer's step with unpadded attention reaches no item()/int(t)/nonzero: the only such calls are
    Adam's step counter, a CPU tensor even on a GPU (no sync there). Without the loader's packings the same
    recorder sees the packing's two syncs per packing, so it would see a regression."""
    t = make_trainer(tmp_path, "trainer.unpadded_attention=true", f"trainer.pad_to_multiple={pad_to_multiple}")
    assert t.data.packings  # the trainer asks its loaders for packed batches
    items = [t.data.train[i] for i in range(7)]
    for packed, expect_model_syncs in ((True, False), (False, True)):
        micro = [collate(items[:5], packed=packed), collate(items[5:], packed=packed)]  # the loader's work
        with SyncRecorder() as rec:
            t._optimizer_step(micro)
        ours = [c for c in rec.calls if not any("torch/optim" in f for f in c[1])]
        from_packing = [c for c in ours if any("varlen.py" in f for f in c[1])]
        if expect_model_syncs:
            assert len(from_packing) == 2 * 2 * 2, ours  # 2 micro-batches x 2 packings x (nonzero, int)
        else:
            assert ours == [], ours


def test_loaders_yield_packed_batches(tmp_path):
    t = make_trainer(tmp_path, "trainer.unpadded_attention=true")
    batch = next(iter(t.data.train_loader(0)))
    assert batch.packings is not None and batch.packings[1].B == len(batch)
    assert next(iter(t.data.valid_loader())).packings is not None
    off = make_trainer(tmp_path / "off")
    assert next(iter(off.data.train_loader(0))).packings is None


@pytest.mark.gpu
def test_cuda_unpadded_step_has_no_host_sync():
    """On a GPU: a pinned, packed batch copied non_blocking, forward, loss and backward with unpadded attention
    (P_drop 0: torch's varlen kernel, or flash-attn's) make no synchronising CUDA call; the device-side packing
    (no packings passed) makes at least one, so the count is sensitive."""
    from transformer.training.tools.profiling import host_syncs
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=0.0)
    model = Transformer.from_config(cfg, 30, 30, True, options=ModelOptions(unpadded_attention=True)).cuda()
    host = collate(varied_items(), packed=True).pin_memory()

    def step(with_packings):
        batch = host.to(torch.device("cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch.src, batch.tgt_in, packings=batch.packings if with_packings else None)
        loss, _ = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.1, PAD)
        loss.backward()

    step(True)  # warm-up: kernels chosen, memory allocated
    assert host_syncs(lambda: step(True)) == []
    assert len(host_syncs(lambda: step(False))) >= 1
