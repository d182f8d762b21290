"""torch's varlen attention op as a GPU runs it under trainer.unpadded_attention, here on a CPU. The op
(`torch.nn.attention.varlen.varlen_attn`, a `torch_attn::` custom op) has a CUDA flash kernel only; these tests give
it a CPU kernel, exact attention over each sentence that `cu_seqlens` marks, so that everything around the kernel
runs as on a GPU: the arguments the model passes, the op's own autograd and fake (shape) functions, and
torch.compile tracing it into a graph with the packed budgets' varying sizes (`make bench-gpu`'s `all+unpadded`
and `compile+unpadded`, which no lease has yet run to the end). The kernel itself, flash on a GPU, is the GPU
tier's (tests/experimental/test_varlen.py)."""
import inspect

import pytest
import torch

from tests.experimental.test_varlen import padded_then_unpadded, varied_batch
from tests.helpers.composed import small_trainer as make_trainer  # composed once a process
from tests.helpers.numerics import assert_close_scaled
from tests.training.speed.test_graphs import run
from transformer.experimental import packed, varlen
from transformer.specials import PAD

ops = pytest.importorskip("torch.nn.attention.varlen", reason="torch < 2.10 has no varlen op")
CALLS = []  # the stand-in kernel's calls: (is_causal, query rows)


def _sentences(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _probabilities(q, k, is_causal, scale):
    """q (L, h, d_k), k (S, h, d_k) of one sentence -> softmax (h, L, S) and its log-sum-exp (h, L), in fp32."""
    s = torch.einsum("lhd,shd->hls", q.float(), k.float()) * (scale or q.size(-1) ** -0.5)
    if is_causal:  # flash's convention: the last query sees every key
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1 + S - L), float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp(), lse


def _arguments(op, args, kwargs) -> dict:
    bound = inspect.signature(op._init_fn).bind(*args, **kwargs)  # this torch's schema, whatever its release
    bound.apply_defaults()
    return bound.arguments


def _forward(*args, **kwargs):
    a = _arguments(ops._varlen_attn, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    CALLS.append((a["is_causal"], q.size(0)))
    out, lse = torch.empty_like(q), q.new_empty(q.size(1), q.size(0), dtype=torch.float)
    for rq, rk in _sentences(a["cu_seq_q"], a["cu_seq_k"]):
        p, lse[:, rq] = _probabilities(q[rq], k[rk], a["is_causal"], a["scale"])
        out[rq] = torch.einsum("hls,shd->lhd", p, v[rk].float()).to(q.dtype)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _backward(*args, **kwargs):
    """Attention's gradient from the saved output (flash's): dS = P * (dP - rowsum(dO * O))."""
    a = _arguments(ops._varlen_attn_backward, args, kwargs)
    q, k, v, out, grad = a["query"], a["key"], a["value"], a["out"], a["grad_out"]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    scale = a["scale"] or q.size(-1) ** -0.5
    for rq, rk in _sentences(a["cu_seq_q"], a["cu_seq_k"]):
        p, _ = _probabilities(q[rq], k[rk], a["is_causal"], a["scale"])
        g = grad[rq].float()  # (L, h, d_k)
        dv[rk] = torch.einsum("hls,lhd->shd", p, g).to(v.dtype)
        dp = torch.einsum("lhd,shd->hls", g, v[rk].float())
        ds = p * (dp - (g * out[rq].float()).sum(-1).T[..., None]) * scale
        dq[rq] = torch.einsum("hls,shd->lhd", ds, k[rk].float()).to(q.dtype)
        dk[rk] = torch.einsum("hls,lhd->shd", ds, q[rq].float()).to(k.dtype)
    return dq, dk, dv


@pytest.fixture
def torchs_op_on_cpu(monkeypatch):
    """The model's attention on torch's varlen op wherever P_drop is 0 (as on a GPU in bf16), the op running the
    stand-in kernel. Registered once a process: nothing else calls the op on a CPU, where it has no kernel."""
    if "cpu" not in ops._varlen_attn._backend_fns:
        ops._varlen_attn.register_kernel("cpu", _forward)
        ops._varlen_attn_backward.register_kernel("cpu", _backward)
    varlen.load_kernels()
    monkeypatch.setattr(varlen, "varlen_kernel", lambda q, p: varlen.torch_varlen_attn if p == 0 else None)
    CALLS.clear()
    return CALLS


@pytest.mark.parametrize("norm_first", [False, True])
def test_torchs_varlen_op_equals_the_padded_model(torchs_op_on_cpu, norm_first):
    """Every attention of the packed model goes through the op (encoder, causal decoder, encoder-decoder), with
    the outputs and gradients of the padded model (P_drop 0: the packed rows would draw other dropout masks):
    the cumulative lengths, the causal flag and the shapes the model hands the op are what a flash kernel
    expects."""
    (a, la, ga), (b, lb, gb) = padded_then_unpadded(norm_first)
    src, tgt = varied_batch()
    n_src, n_tgt = int((src != PAD).sum()), int((tgt != PAD).sum())
    # 2 encoder layers' self-attention, 3 decoder layers' causal self-attention and cross-attention
    assert sorted(torchs_op_on_cpu) == sorted([(False, n_src)] * 2 + [(True, n_tgt)] * 3 + [(False, n_tgt)] * 3)
    n = 64  # the longest sums: d_ff's (a weight's gradient sums the 36 rows of the (4, 9) source)
    assert_close_scaled(b, a, n)
    assert_close_scaled(lb, la, n)
    for name in ga:
        assert_close_scaled(gb[name], ga[name], n, msg=name)


def varied_budgets(t, sizes=(3, 6, 12, 5, 9, 14, 2, 7, 11, 4, 8, 13)):
    """Packed micro-batches of `sizes` sentences each, two a step: budgets of several sizes, so the compiled
    model meets packings of several widths and token counts, as a real run's do."""
    items = [t.data.train[i] for i in range(sum(sizes))]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    micro = [packed.collate(items[e - n:e], t.data.train_sampler.cap) for n, e in zip(sizes, ends, strict=True)]
    return [micro[i:i + 2] for i in range(0, len(micro), 2)]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "layers"])
def test_compiled_step_traces_torchs_varlen_op_into_at_most_two_graphs(tmp_path, torchs_op_on_cpu, scope):
    """trainer.compile (whole model or per layer) on packed budgets of varied sizes, attention on torch's op:
    no graph break, at most two graphs (the budgets' sizes made dynamic), the op called by every attention of
    every compiled step, and the eager step's statistics and gradient norms (fp32, P_drop 0)."""
    from torch._dynamo.utils import counters

    common = ("trainer.precision=fp32", "trainer.static_shapes=true", "trainer.unpadded_attention=true",
              "model.attention_dropout=0", "model.dropout=0.0", "trainer.accumulate=2")
    eager = make_trainer(tmp_path / "eager", *common)
    compiled = make_trainer(tmp_path / "compiled", *common, "trainer.compile=true",
                            f"trainer.compile_scope={scope}")
    steps = varied_budgets(eager)
    assert len({packed.shape_of(b) for step in steps for b in step}) >= 4
    expected = run(eager, steps)
    eager_calls = list(torchs_op_on_cpu)
    torchs_op_on_cpu.clear()
    counters.clear()
    got = run(compiled, steps)
    assert dict(counters["graph_break"]) == {}
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
    # model.N=1: three attentions a forward, two forwards (micro-batches) a step
    assert sorted(torchs_op_on_cpu) == sorted(eager_calls) and len(eager_calls) == 3 * 2 * len(steps)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b.stats, a.stats, rtol=1e-6, atol=0)
        torch.testing.assert_close(b.grad_norm, a.grad_norm, rtol=1e-5, atol=0)
