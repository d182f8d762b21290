"""trainer.unpadded_attention (transformer/model/varlen.py): the packed model's outputs and gradients equal the
padded model's on a batch of varied lengths (P_drop 0), on the CPU reference path."""
import pytest
import torch

from tests.test_trainer import make_trainer
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.model.varlen import pack, packing, unpack
from transformer.specials import PAD
from transformer.training.loss import label_smoothed_cross_entropy


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


@pytest.mark.parametrize("norm_first", [False, True])
def test_unpadded_equals_padded_outputs_and_gradients(norm_first):
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, N_dec=3, d_model=32, d_ff=64, h=4, dropout=0.0, norm_first=norm_first)
    model = Transformer.from_config(cfg, 30, 30, True).train()
    src, tgt = varied_batch()
    real = tgt != PAD
    results = []
    for on in (False, True):
        model.set_unpadded_attention(on)
        model.zero_grad()
        logits = model(src, tgt)  # (B, T, V)
        loss, _ = label_smoothed_cross_entropy(logits, torch.where(real, tgt, PAD), 0.1, PAD)
        loss.backward()
        results.append((logits[real].detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, la, ga), (b, lb, gb) = results
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5) and torch.allclose(la, lb, rtol=1e-6)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6, rtol=1e-4), name


def test_trainer_switch(tmp_path):
    """The switch reaches the model; a run with it (and the bf16 stream) trains, validates and decodes."""
    t = make_trainer(tmp_path, "trainer.unpadded_attention=true", "trainer.bf16_residual=true",
                     "trainer.max_steps=3", "trainer.max_epochs=null", "trainer.val_every=3")
    assert t.model.unpadded_attention and t.train() == 0
    assert not make_trainer(tmp_path / "off").model.unpadded_attention


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_varlen_kernel_equals_padded(dropout):
    """On a GPU under bf16 autocast the packed model runs flash-attn's varlen kernel (where installed) or
    torch's varlen_attn (P_drop 0): outputs within bf16 rounding of the padded model's (in eval mode, so
    dropout is off in both), and a training step with dropout runs and gives finite gradients."""
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=dropout)
    model = Transformer.from_config(cfg, 30, 30, True).cuda()
    src, tgt = (t.cuda() for t in varied_batch())
    real = tgt != PAD
    outs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.eval()
        for on in (False, True):
            model.set_unpadded_attention(on)
            outs.append(model(src, tgt)[real].float())
    assert (outs[0] - outs[1]).norm() / outs[0].norm() < 2e-2
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = label_smoothed_cross_entropy(model(src, tgt), tgt, 0.1, PAD)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
