"""The CPU dropout (transformer/model/dropout.py): keep rate, scale, gradient, lanes, seeding, eval mode."""
import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.numerics import scaled
from transformer.model.dropout import Dropout, keep_mask


def test_keep_rate_and_scale_match_p():
    torch.manual_seed(0)
    p, n = 0.1, 1 << 20
    mask = keep_mask(torch.Size([n]), p, torch.float32)
    kept = mask > 0
    # 1M draws: the keep rate's standard deviation is 3e-4, so 2e-3 is over six of them.
    assert abs(kept.float().mean().item() - (1 - p)) < 2e-3
    assert torch.all(mask[kept] == 65536 / (65536 - round(p * 65536)))
    assert abs(mask.mean().item() - 1.0) < 3e-3  # E[out] = x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_survivors_are_scaled_by_the_exact_rate(dtype):
    """In bf16 a mask holding the scale would hold 1.109375 for P_drop 0.1, not 1.1111: every survivor 0.16 % too
    small, E[out] below x. Each survivor is x times the exact scale, rounded once: the ratios out / x, rounded
    up and down from one x to the next, average to the scale within 1e-4 (the mask's own value is 1.6e-3 off)."""
    torch.manual_seed(3)
    drop = Dropout(0.1).train()
    x = torch.randn(1 << 18, dtype=dtype).clamp(min=-4, max=4)
    x = x[x.abs() > 1e-3]  # no zeros or subnormal ratios
    out = drop(x)
    kept = out != 0
    assert out.dtype == dtype and abs(kept.float().mean().item() - 0.9) < 3e-3
    scale = 65536 / (65536 - round(0.1 * 65536))
    ratio = (out[kept].double() / x[kept].double()).mean().item()
    assert abs(ratio - scale) < 1e-4, ratio
    assert torch.equal(out[kept], (x[kept].float() * scale).to(dtype))


def test_every_16_bit_lane_is_uniform():
    """Each int64 draw feeds four elements in a row; each of the four positions must keep 1 - p of its elements
    (a draw that stops at 2**63 - 1 would keep every fourth element with probability 1)."""
    torch.manual_seed(1)
    p, rows = 0.3, 1 << 18
    kept = (keep_mask(torch.Size([rows, 4]), p, torch.float32) > 0).float().mean(0)  # (4,) per lane
    assert torch.all((kept - (1 - p)).abs() < 4e-3), kept


@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (2, 1, 6)])
def test_gradient_uses_the_forward_mask(shape):
    torch.manual_seed(2)
    drop = Dropout(0.5).train()
    x = torch.randn(shape, requires_grad=True)
    out = drop(x)
    out.sum().backward()
    scale = torch.where(x != 0, out / x, torch.zeros_like(x))
    assert torch.allclose(x.grad, scale.detach())
    assert set(torch.unique(x.grad).tolist()) <= {0.0, 2.0}


def test_seeded_and_identity_in_eval():
    drop = Dropout(0.2)
    x = torch.randn(64, 32)
    torch.manual_seed(3)
    a = drop(x)
    torch.manual_seed(3)
    assert torch.equal(a, drop(x))
    assert not torch.equal(a, drop(x))  # the generator moved on
    assert drop.eval()(x) is x
    assert Dropout(0.0).train()(x) is x


def test_bad_probability_is_refused():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)


def test_compiles_into_one_graph():
    """Under torch.compile the module is torch's dropout, so a model that uses it traces as one graph."""
    drop = Dropout(0.3).train()
    compiled = torch.compile(drop, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(torch.ones(4, 8))
    assert torch.all((out == 0) | torch.isclose(out, torch.tensor(1 / 0.7)))


# ---- attention dropout on CPUs (transformer/model/layers.py: _cpu_dropout_attention) ----------------------

def _attention_inputs(dtype, B=3, h=2, T=5, S=7, d_k=8):
    torch.manual_seed(4)
    q = torch.randn(B, h, T, d_k, dtype=dtype, requires_grad=True)
    k = torch.randn(B, h, S, d_k, dtype=dtype, requires_grad=True)
    v = torch.randn(B, h, S, d_k, dtype=dtype, requires_grad=True)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., 4:] = False  # a padded source
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_without_drops_is_sdpa(monkeypatch, dtype, causal):
    """With a mask that keeps everything, the CPU path is SDPA's (fp32 inside, like SDPA's math path)."""
    import torch.nn.functional as F

    from transformer.model import layers
    monkeypatch.setattr(layers, "keep_mask", lambda shape, p, dt: torch.ones(shape, dtype=dt))
    q, k, v, mask = _attention_inputs(dtype, S=5 if causal else 7)
    mask = None if causal else mask
    ours = layers._cpu_dropout_attention(q, k, v, mask, causal, 0.3)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    assert ours.dtype == dtype
    tol = scaled(ref, 8, torch.float32)  # fp32 sums of d_k = 8 terms in another order
    tol["rtol"] += torch.finfo(dtype).eps / 2 if dtype == torch.bfloat16 else 0  # then one rounding to bf16
    assert torch.allclose(ours.float(), ref, **tol)


def test_cpu_attention_drops_weights_with_the_cheap_mask():
    """Seeded, the output is softmax(QK^T/sqrt(d_k)) * keep_mask @ V with the same draw; gradients pass gradcheck
    through a fixed mask."""
    from transformer.model.layers import _cpu_dropout_attention
    q, k, v, mask = _attention_inputs(torch.float64)
    torch.manual_seed(5)
    out = _cpu_dropout_attention(q, k, v, mask, False, 0.25)
    torch.manual_seed(5)
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    drops = keep_mask(torch.Size([3, 2, 5, 7]), 0.25, torch.float64)
    assert torch.allclose(out, (scores.softmax(-1) * drops) @ v)
    assert (drops == 0).any() and (drops > 1).any()

    # gradcheck on smaller inputs (its finite differences cost a forward per input element: 104 here, not 912),
    # a padded key and dropped weights among them
    q, k, v, mask = _attention_inputs(torch.float64, B=2, h=1, T=3, S=5, d_k=4)
    torch.manual_seed(5)
    drops = keep_mask(torch.Size([2, 1, 3, 5]), 0.25, torch.float64)
    assert (drops == 0).any() and (drops > 1).any() and not mask.all()

    def seeded(q, k, v):
        torch.manual_seed(5)
        return _cpu_dropout_attention(q, k, v, mask, False, 0.25)
    assert torch.autograd.gradcheck(seeded, (q, k, v))


def test_training_attention_uses_the_cpu_path_only_with_dropout(monkeypatch):
    from transformer.model import layers
    calls = []
    real = layers._cpu_dropout_attention
    monkeypatch.setattr(layers, "_cpu_dropout_attention", lambda *a: calls.append(a[-1]) or real(*a))
    attn = layers.MultiHeadAttention(16, 2, 0.1)
    x = torch.randn(2, 3, 16)
    attn.train()(x, is_causal=True)
    attn.eval()(x, is_causal=True)  # no dropout: SDPA's fused kernel
    layers.MultiHeadAttention(16, 2, 0.0).train()(x)
    assert calls == [0.1]


def _model(**kw):
    from transformer.model import ModelArgs, Transformer

    args = dict(N=1, N_dec=1, d_model=16, d_ff=32, h=2, dropout=0.1, norm_first=False, tie_embeddings="decoder",
                max_positions=64, src_vocab_size=20, tgt_vocab_size=20, shared_vocab=False)
    return Transformer(ModelArgs(**{**args, **kw}))


def _rates(model):
    from transformer.model.layers import MultiHeadAttention

    attention = {m.dropout for m in model.modules() if isinstance(m, MultiHeadAttention)}
    other = {m.p for m in model.modules() if isinstance(m, Dropout)}
    return attention, other


def _ffn_rates(model):
    from transformer.model.layers import FeedForward

    ffn = [m.dropout for m in model.modules() if isinstance(m, FeedForward)]
    other = {m.p for m in model.modules() if isinstance(m, Dropout) and all(m is not f for f in ffn)}
    return {m.p for m in ffn}, other


def test_attention_dropout_sets_the_attention_weights_rate_alone_and_survives_a_schedule():
    """model.attention_dropout: the paper's Section 5.4 drops sublayer outputs and embeddings, not attention
    weights; null keeps P_drop there (checkpoints before the key); trainer.dropout_by_epoch leaves a set rate."""
    assert _rates(_model()) == ({0.1}, {0.1})
    model = _model(attention_dropout=0.0)
    assert _rates(model) == ({0.0}, {0.1})
    model.set_dropout(0.3)
    assert _rates(model) == ({0.0}, {0.3})
    plain = _model()
    plain.set_dropout(0.3)
    assert _rates(plain) == ({0.3}, {0.3})
    assert _rates(_model(attention_dropout=0.2, dropout=0.0)) == ({0.2}, {0.0})


def test_attention_dropout_zero_trains_attention_without_a_random_mask(monkeypatch):
    """At 0 every attention call of a training forward gets dropout_p 0 (SDPA's kernels, no mask drawn), while
    the sublayers still drop at P_drop: two forwards differ, their attention calls are all p=0."""
    from transformer.model import layers

    seen = []
    real = layers.MultiHeadAttention._attend
    monkeypatch.setattr(layers.MultiHeadAttention, "_attend",
                        lambda self, q, k, v, mask, causal, p: seen.append(p) or real(self, q, k, v, mask, causal, p))
    model = _model(attention_dropout=0.0).train()
    src, tgt = torch.randint(4, 20, (3, 6)), torch.randint(4, 20, (3, 5))
    assert not torch.equal(model(src, tgt), model(src, tgt))  # residual and embedding dropout still on
    assert seen and set(seen) == {0.0}
    seen.clear()
    _model().train()(src, tgt)
    assert set(seen) == {0.1}


def test_checkpoints_without_attention_dropout_load_with_p_drop_there():
    from transformer.model import ModelArgs

    old = {k: v for k, v in _model().args.to_dict().items() if k != "attention_dropout"}
    assert ModelArgs.from_dict(old).attention_dropout is None
    assert ModelArgs.from_dict({**old, "attention_dropout": 0.0}).attention_dropout == 0.0


def test_ffn_dropout_sets_the_feed_forward_rate_alone_and_survives_a_schedule():
    """model.ffn_dropout: the dropout after the feed-forward network's activation (not in Section 5.4) at its own
    rate; null keeps P_drop there (checkpoints before the key); trainer.dropout_by_epoch leaves a set rate."""
    assert _ffn_rates(_model()) == ({0.1}, {0.1})
    model = _model(ffn_dropout=0.0, attention_dropout=0.05)
    assert _ffn_rates(model) == ({0.0}, {0.1}) and _rates(model)[0] == {0.05}
    model.set_dropout(0.3)
    assert _ffn_rates(model) == ({0.0}, {0.3}) and _rates(model)[0] == {0.05}
    plain = _model()
    plain.set_dropout(0.3)
    assert _ffn_rates(plain) == ({0.3}, {0.3})
    from transformer.model import ModelArgs

    old = {k: v for k, v in _model().args.to_dict().items() if k != "ffn_dropout"}
    assert ModelArgs.from_dict(old).ffn_dropout is None


def test_ffn_dropout_zero_leaves_the_feed_forward_output_deterministic():
    """With ffn_dropout=0 and P_drop 0.1 elsewhere, the feed-forward network of a training model is the same
    function twice; with the default it is not."""
    from transformer.model.layers import FeedForward

    x = torch.randn(4, 7, 16)
    for rate, same in ((0.0, True), (None, False)):
        ff = next(m for m in _model(ffn_dropout=rate).train().modules() if isinstance(m, FeedForward))
        assert torch.equal(ff(x), ff(x)) == same


@pytest.mark.parametrize("overrides,p_drop", [(("model=base",), 0.1), (("model=big",), 0.3),
                                              (("experiment=wmt14_base",), 0.1), (("experiment=wmt14_big",), 0.3)])
def test_the_papers_models_drop_where_section_5_4_says(overrides, p_drop):
    """model=base and big (and the WMT14 recipes built on them): P_drop on the sublayer outputs and embedding sums
    only, none on the attention weights or inside the feed-forward network (tensor2tensor's transformer_base_v1)."""
    from transformer.model.layers import FeedForward

    cfg = compose_cfg(*overrides, "model.N=1", "model.d_model=16", "model.d_ff=32", "model.h=2")
    model = _model(**{k: cfg.model[k] for k in ("dropout", "attention_dropout", "ffn_dropout")})
    ffn = {m.dropout.p for m in model.modules() if isinstance(m, FeedForward)}
    assert _rates(model)[0] == {0.0} and ffn == {0.0}
    assert {m.p for m in model.modules() if isinstance(m, Dropout)} == {0.0, p_drop}  # the FFN's own at 0 too
    assert cfg.model.dropout == p_drop


def test_the_small_models_keep_p_drop_everywhere_and_multi30k_takes_the_papers_placement():
    """model=small and tiny keep null: P_drop on the attention weights and in the feed-forward network too, as
    their recipes were measured with; experiment=multi30k drops only where Section 5.4 says since tried 42
    (docs/multi30k.md), as model=base and big do."""
    for overrides in (("model=small",), ("model=tiny",)):
        cfg = compose_cfg(*overrides)
        assert (cfg.model.attention_dropout, cfg.model.ffn_dropout) == (None, None), overrides
    cfg = compose_cfg("experiment=multi30k")
    assert (cfg.model.attention_dropout, cfg.model.ffn_dropout, cfg.model.dropout) == (0.0, 0.0, 0.2)
