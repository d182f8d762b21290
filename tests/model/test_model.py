import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.numerics import close_scaled
from transformer.config import ModelConfig
from transformer.data.batch import PAD
from transformer.model import ModelArgs, Transformer
from transformer.model.layers import MultiHeadAttention


def make_model(norm_first=False, tie="decoder", V=23, shared=True):
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, norm_first=norm_first, tie_embeddings=tie)
    return Transformer.from_config(cfg, V, V, shared).eval()


SUMS = 64  # d_ff: the longest sum in these models' forward, which a cache or another shape may order otherwise


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_is_causal(norm_first):
    """Changing target token t+1 never changes decoder output at positions <= t."""
    model = make_model(norm_first)
    src = torch.randint(4, 23, (2, 7))
    tgt = torch.randint(4, 23, (2, 6))
    base = model(src, tgt)
    for t in range(5):
        changed = tgt.clone()
        changed[:, t + 1:] = torch.randint(4, 23, changed[:, t + 1:].shape)
        out = model(src, changed)
        assert close_scaled(out[:, :t + 1], base[:, :t + 1], SUMS)
        assert not close_scaled(out[:, t + 1:], base[:, t + 1:], SUMS)


@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_never_leaks(norm_first):
    """Changing the tokens at pad positions never changes the outputs at non-pad positions."""
    model = make_model(norm_first)
    src = torch.randint(4, 23, (3, 8))
    src[0, 5:] = PAD
    src[2, 3:] = PAD
    tgt = torch.randint(4, 23, (3, 6))
    base = model(src, tgt)
    memory, _ = model.encode(src)
    garbage = src.clone()
    garbage[src == PAD] = torch.randint(4, 23, (int((src == PAD).sum()),))
    # The garbage tokens are real tokens now; masking them as pad must make them invisible again.
    model_mask = (src != PAD)[:, None, None, :]
    mem2 = model.src_embed(garbage)
    for layer in model.encoder:
        mem2 = layer(mem2, model_mask)
    mem2 = model.enc_norm(mem2)
    keep = src != PAD
    assert close_scaled(mem2[keep], memory[keep], SUMS)
    assert close_scaled(model.decode(tgt, mem2, model_mask), base, SUMS)


def reference_attention(q, k, v, mask):
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("kind", ["causal", "padded", "cross"])
def test_attention_matches_plain_softmax_reference(kind):
    """Self-attention (one stacked q/k/v product: its three parts are the separate projections) and
    cross-attention (keys/values given) agree with softmax(Q K^T / sqrt(d_k)) V."""
    torch.manual_seed(1)
    attn = MultiHeadAttention(d_model=24, h=3, dropout=0.0, self_attention=kind != "cross").eval()
    x = torch.randn(2, 5, 24)
    key_pad = torch.ones(2, 1, 1, 5 if kind == "padded" else 7, dtype=torch.bool)
    key_pad[1, ..., 4:] = False
    kv = torch.randn(2, 2, 3, 7, 8)  # (2, B, h, S, d_k)
    if kind == "cross":
        def run():
            return attn(x, kv, mask=key_pad)
        q, (k, v), mask = attn.split_heads(attn.q_proj(x)), kv, key_pad
    else:
        def run():
            return attn(x, is_causal=True) if kind == "causal" else attn(x, mask=key_pad)
        w, b = attn.qkv_proj.weight.split(24), attn.qkv_proj.bias
        q, k, v = (attn.split_heads(F.linear(x, wi, bi)) for wi, bi in zip(w, [b[0], None, b[1]], strict=True))
        mask = torch.ones(5, 5, dtype=torch.bool).tril() if kind == "causal" else key_pad
    out = run()
    ref = reference_attention(q, k, v, mask).transpose(1, 2).reshape(2, 5, 24)
    assert close_scaled(out, attn.out_proj(ref), 24)  # d_model: the longest sum
    attn.keep_attention = True  # the explicit path used for plots agrees too
    assert close_scaled(run(), out, 24)
    assert torch.allclose(attn.last_attention.sum(-1), torch.ones(2, 3, 5))


def test_incremental_decoding_matches_full_decoding():
    model = make_model()
    src = torch.randint(4, 23, (3, 6))
    tgt = torch.randint(4, 23, (3, 5))
    memory, mask = model.encode(src)
    full = model.decode(tgt, memory, mask)
    cache = model.new_cache(memory, mask)
    steps = torch.cat([model.decode(tgt[:, i:i + 1], cache=cache) for i in range(5)], dim=1)
    assert close_scaled(steps, full, SUMS)


def test_embedding_scale_and_tying():
    model = make_model(tie="all")
    assert model.generator.weight is model.tgt_embed.tokens.weight is model.src_embed.tokens.weight
    assert model.src_embed.scale == pytest.approx(math.sqrt(32))
    untied = make_model(tie="none")
    assert untied.generator.weight is not untied.tgt_embed.tokens.weight


def test_tie_all_needs_shared_vocabulary():
    with pytest.raises(ValueError, match="tie_embeddings=all needs one shared"):
        make_model(tie="all", shared=False)


def test_target_vocabulary_is_the_first_rows_of_the_shared_matrix():
    """tokenizer.tgt_vocab=seen: 23 shared types, the first 15 the target's. The generator scores those 15 with
    the shared matrix's first rows (the same logits as the full model's first 15), the checkpoint's keys and
    shapes are the full model's, and every row still trains through the source embedding."""
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, tie_embeddings="all")
    small = Transformer.from_config(cfg, 23, 15, True).eval()
    full = Transformer.from_config(cfg, 23, 23, True).eval()
    full.load_state_dict(small.state_dict())
    assert small.generator.weight is small.src_embed.tokens.weight and small.generator.weight.shape == (23, 32)
    src, tgt = torch.randint(4, 23, (2, 6)), torch.randint(4, 15, (2, 5))
    logits = small(src, tgt)
    assert logits.shape == (2, 5, 15)
    assert close_scaled(logits, full(src, tgt)[..., :15], SUMS)
    logits.logsumexp(-1).sum().backward()
    grad = small.src_embed.tokens.weight.grad
    assert grad[4:15].abs().sum() > 0 and grad[15:].abs().sum() > 0  # the last rows: from the source side
    with pytest.raises(ValueError, match="tie_embeddings=all needs one shared"):
        Transformer.from_config(cfg, 15, 23, True)


def test_decoder_depth_apart_from_the_encoder():
    """model.N_dec: a shallow decoder under a deeper encoder; decoding with the key/value cache equals the
    full decoder pass, and the checkpoint's arguments rebuild it."""
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=3, N_dec=1, d_model=32, d_ff=64, h=4, dropout=0.0), 23, 23).eval()
    assert (len(model.encoder), len(model.decoder), model.args.N_dec) == (3, 1, 1)
    src, tgt = torch.randint(4, 23, (2, 5)), torch.randint(4, 23, (2, 4))
    memory, src_mask = model.encode(src)
    cache = model.new_cache(memory, src_mask)
    stepwise = torch.cat([model.decode(tgt[:, t:t + 1], cache=cache) for t in range(tgt.size(1))], dim=1)
    assert close_scaled(stepwise, model(src, tgt), SUMS)
    clone = Transformer(ModelArgs.from_dict(model.args.to_dict()))
    clone.load_state_dict(model.state_dict())
    assert Transformer.from_config(ModelConfig(N=2), 23, 23).args.N_dec == 2  # null: as many as the encoder


def test_model_args_without_n_dec_mean_n_layers_each_side():
    """Checkpoints written before model.N_dec existed load, resume and average as N layers on both sides."""
    old = {k: v for k, v in make_model().args.to_dict().items() if k != "N_dec"}
    assert ModelArgs.from_dict(old) == make_model().args
    assert ModelArgs.upgrade(old) == make_model().args.to_dict()


def test_rebuild_from_model_args():
    model = make_model()
    clone = Transformer(ModelArgs.from_dict(model.args.to_dict()))
    clone.load_state_dict(model.state_dict())
    src, tgt = torch.randint(4, 23, (2, 5)), torch.randint(4, 23, (2, 4))
    assert torch.equal(clone.eval()(src, tgt), model(src, tgt))


def _bool_mask_forward(model, src, tgt):
    """The model's forward with the boolean padding mask SDPA converts itself in every call (before
    `padding_bias`)."""
    keep = (src != PAD)[:, None, None, :]
    x = model.src_embed(src)
    for layer in model.encoder:
        x = layer(x, keep)
    return model.decode(tgt, model.enc_norm(x), keep)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_padding_bias_is_made_once_in_the_queries_dtype_and_changes_no_output(dtype, monkeypatch):
    """The source mask is additive (0 / -inf), in autocast's dtype, rows 8-aligned, and every SDPA call of a
    forward gets it (nothing to convert or pad per call); the outputs are bitwise those of the boolean mask,
    in eval mode and in training with dropout (the CPU dropout path adds it instead of masked_fill)."""
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.1), 23, 23)
    src, tgt = torch.randint(4, 23, (3, 11)), torch.randint(4, 23, (3, 6))
    src[0, 7:] = src[2, 3:] = PAD
    auto = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        masks.append((q.dtype, attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    with auto:
        _, mask = model.encode(src)
        assert mask.dtype == (dtype or torch.float32) and mask.shape == (3, 1, 1, 11) and mask.stride(0) % 8 == 0
        assert torch.equal(mask[:, 0, 0] == float("-inf"), src == PAD) and (mask[src[:, None, None] != PAD] == 0).all()
        for train in (False, True):
            model.train(train)
            torch.manual_seed(1)
            with monkeypatch.context() as m:
                m.setattr(F, "scaled_dot_product_attention", recording)
                out = model(src, tgt)
            torch.manual_seed(1)
            assert torch.equal(out, _bool_mask_forward(model, src, tgt))
    padded = [(q_dtype, m) for q_dtype, m in masks if m is not None]
    assert len(padded) == 4  # eval: 2 encoder self-attentions and 2 cross-attentions; training takes the CPU path
    assert all(m.dtype == q_dtype and m.stride(0) % 8 == 0 for q_dtype, m in padded)
