"""Stacked projections (transformer/model/projections.py): one q/k/v product per self-attention, one key/value
product of the encoder output for all decoder layers. Same mathematics as separate projections, checkpoints
written with separate projections load (weights, weight average and Adam moments), and `split_projections`
gives exporters the separate names back."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.composed import small_trainer as make_trainer  # composed once a process
from tests.helpers.decoding import beam
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.model.projections import fuse_projections, separate_parameter_order, split_projections
from transformer.specials import PAD
from transformer.training.components.checkpoint import stack_projections


def make(N=2, N_dec=3, norm_first=False, tie="decoder", seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(N=N, N_dec=N_dec, d_model=32, d_ff=64, h=4, dropout=0.0, norm_first=norm_first,
                      tie_embeddings=tie)
    return Transformer.from_config(cfg, 23, 23, True).eval()


def separate_forward(model: Transformer, w: dict, src, tgt) -> torch.Tensor:
    """The model's forward with separate q, k and v products from the old-layout weights `w`."""
    h = model.args.h

    def heads(x):
        return x.view(x.size(0), x.size(1), h, -1).transpose(1, 2)  # (B, h, T, d_k)

    def attention(at, y, memory=None, mask=None, causal=False):
        kv = y if memory is None else memory
        q = heads(F.linear(y, w[f"{at}.q_proj.weight"], w[f"{at}.q_proj.bias"]))
        k = heads(F.linear(kv, w[f"{at}.k_proj.weight"]))
        v = heads(F.linear(kv, w[f"{at}.v_proj.weight"], w[f"{at}.v_proj.bias"]))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        out = out.transpose(1, 2).flatten(2)  # (B, T, d_model)
        return F.linear(out, w[f"{at}.out_proj.weight"], w[f"{at}.out_proj.bias"])

    src_mask = (src != PAD)[:, None, None, :]
    x = model.src_embed(src)
    for i, layer in enumerate(model.encoder):
        x = layer.sub1(x, lambda y, i=i: attention(f"encoder.{i}.self_attn", y, mask=src_mask))
        x = layer.sub2(x, layer.ff)
    memory = model.enc_norm(x)
    x = model.tgt_embed(tgt)
    for i, layer in enumerate(model.decoder):
        x = layer.sub1(x, lambda y, i=i: attention(f"decoder.{i}.self_attn", y, causal=True))
        x = layer.sub2(x, lambda y, i=i: attention(f"decoder.{i}.cross_attn", y, memory, src_mask))
        x = layer.sub3(x, layer.ff)
    return model.generator(model.dec_norm(x))


@pytest.mark.parametrize("norm_first", [False, True])
def test_stacked_products_equal_separate_products(norm_first):
    """fp32 on a CPU: the logits of the stacked model equal those of separate q/k/v products with the same
    weights up to the summation order of a matrix product."""
    model = make(norm_first=norm_first)
    src, tgt = torch.randint(4, 23, (3, 7)), torch.randint(4, 23, (3, 6))
    src[1, 4:] = PAD
    with torch.no_grad():
        ref = separate_forward(model, split_projections(model.state_dict()), src, tgt)
        out = model(src, tgt)
    assert (out - ref).norm() / ref.norm() < 1e-6


def test_old_layout_loads_and_splits_back():
    """A state dict with separate projections loads through `load_state_dict` (the model's pre-hook) into equal
    weights; `split_projections` returns the separate names in the order the old model listed them."""
    model = make(tie="all")
    old = split_projections(model.state_dict())
    assert "decoder.2.cross_attn.k_proj.weight" in old and "encoder.1.self_attn.v_proj.bias" in old
    assert not any("qkv_proj" in k or "memory_kv_proj" in k or "self_attn.k_proj.bias" in k for k in old)
    keys = list(old)
    at = keys.index("decoder.1.cross_attn.q_proj.weight")
    assert keys[at:at + 6] == [f"decoder.1.cross_attn.{k}" for k in ("q_proj.weight", "q_proj.bias",
                               "k_proj.weight", "v_proj.weight", "v_proj.bias", "out_proj.weight")]
    other = make(tie="all", seed=1)
    other.load_state_dict(old)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fuse_projections(dict(model.state_dict())).keys() == model.state_dict().keys()  # new layout: unchanged
    assert separate_parameter_order(model)[:3] == ["src_embed.tokens.weight", "encoder.0.self_attn.q_proj.weight",
                                                   "encoder.0.self_attn.q_proj.bias"]


def test_each_stacked_part_drawn_like_a_separate_matrix():
    """Xavier-uniform per (d_model, d_model) part, bound sqrt(6 / (2 d_model)), not one draw over the stack."""
    model = make()
    bound = math.sqrt(6 / 64)
    for w in (model.encoder[0].self_attn.qkv_proj.weight, model.memory_kv_proj.weight):
        for part in w.split(32):
            assert 0.9 * bound < part.abs().max() <= bound


def to_separate(ckpt: dict, model: Transformer) -> dict:
    """`ckpt` as the separate-projection version wrote it: old weight names, old parameter order in Adam."""
    new_names = [n for n, _ in model.named_parameters()]
    moments = dict(zip(new_names, (ckpt["optimizer"]["state"][i] for i in range(len(new_names))), strict=True))
    split = {k: split_projections({n: m[k] for n, m in moments.items()}) for k in ("exp_avg", "exp_avg_sq")}
    step = next(iter(moments.values()))["step"]
    order = separate_parameter_order(model)
    state = {i: {"step": step, "exp_avg": split["exp_avg"][n], "exp_avg_sq": split["exp_avg_sq"][n]}
             for i, n in enumerate(order)}
    group = {**ckpt["optimizer"]["param_groups"][0], "params": list(range(len(order)))}
    return {**ckpt, "model": split_projections(ckpt["model"]), "optimizer": {"state": state, "param_groups": [group]},
            "ema": {**ckpt["ema"], "shadow": split_projections(ckpt["ema"]["shadow"])}}


def test_checkpoint_with_separate_projections_resumes_exactly(tmp_path):
    """Weights, weight average and Adam moments of a separate-projection checkpoint are stacked exactly as this
    version keeps them: the resumed run continues where it would have."""
    t = make_trainer(tmp_path, "trainer.max_steps=2", "trainer.max_epochs=null", "trainer.ema_decay=0.9",
                     "trainer.val_every=1000", "checkpoint.every_steps=1000", "trainer.val_epoch_end=false")
    assert t.train() == 0
    ckpt = t.state_dict()
    old = to_separate(ckpt, t.model)
    assert len(old["optimizer"]["state"]) > len(ckpt["optimizer"]["state"])  # the old layout really differs
    stack_projections(old)
    for part in ("model", ("ema", "shadow")):
        a, b = (ckpt[part], old[part]) if isinstance(part, str) else (ckpt[part[0]][part[1]], old[part[0]][part[1]])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert old["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    for i, s in ckpt["optimizer"]["state"].items():
        assert all(torch.equal(s[k], old["optimizer"]["state"][i][k]) for k in s)
    t.load_state_dict(old)  # and the trainer takes it


def test_beam_search_projects_the_encoder_output_once():
    """Cross-attention keys/values of every decoder layer: one product per source sentence, before the K rows
    of a beam are spread, not one per layer or per row; the outputs equal the uncached search's."""
    from tests.helpers.decoding import Uncached
    model = make()
    src = torch.randint(4, 23, (3, 6))
    calls = []
    handle = model.memory_kv_proj.register_forward_hook(lambda m, args, out: calls.append(args[0].size(0)))
    hyps = beam(model, src, beam=3, max_len_b=5)
    handle.remove()
    assert calls == [3]  # B rows, not B * K
    assert [h[0].tokens for h in hyps] == [h[0].tokens for h in beam(Uncached(model), src, beam=3, max_len_b=5)]


def test_memory_kv_gradient_is_assembled_in_the_products_layout():
    """The memory key/value product's backward gets its gradient as one stack in the product's own (B, S,
    2·N_dec, h, d_k) layout. Decoder layers that indexed a (N_dec, 2, B, h, S, d_k) view had the compiled
    backward build that shape and copy it into the product's layout, two kernels on GPUs (docs/benchmarks/switches.md).
    Read from the backward graph that AOT autograd hands a compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    model = make(N=1, N_dec=3)  # one encoder layer: the memory's products are the decoder's
    B, S, T = 2, 7, 5
    src, tgt = torch.randint(4, 23, (B, S)), torch.randint(4, 23, (B, T))
    torch._dynamo.reset()
    net = torch.compile(model, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                                                    bw_compiler=keep))
    net(src, tgt).sum().backward()
    nodes = [n for n in graphs[-1].graph.nodes if n.op == "call_function"]
    copies = [n for n in nodes if n.target in (torch.ops.aten.clone.default, torch.ops.aten.copy.default)
              and n.meta["val"].numel() == B * S * 2 * 3 * 32]
    assert not copies, [tuple(n.meta["val"].shape) for n in copies]
    assert [tuple(n.meta["val"].shape) for n in nodes if n.target == torch.ops.aten.stack.default
            and n.meta["val"].dim() == 5 and n.meta["val"].shape[2] == 6] == [(B, S, 6, 4, 8)]
