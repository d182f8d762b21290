"""The model-FLOPs formula (transformer/model/flops.py) against torch's own FlopCounterMode on real steps."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from transformer.config import ModelConfig
from transformer.model import ModelArgs, Transformer
from transformer.model.flops import forward_flops, step_flops, training_flops
from transformer.training.components.loss import label_smoothed_cross_entropy


def counted(model, src, tgt, backward: bool) -> int:
    # The math backend spells attention as matrix products, which FlopCounterMode counts on every device
    # (CPU's fused attention kernel has no registered FLOP formula).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        logits = model(src, tgt)
        if backward:
            loss, _ = label_smoothed_cross_entropy(logits, tgt, 0.1, 0)
            loss.backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("B,S,T", [(3, 7, 9), (5, 16, 4)])
@pytest.mark.parametrize("norm_first", [False, True])
def test_training_flops_match_flop_counter(B, S, T, norm_first):
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=2, d_model=64, d_ff=96, h=4, norm_first=norm_first), 50, 70)
    src, tgt = torch.randint(4, 50, (B, S)), torch.randint(4, 70, (B, T))
    measured = counted(model, src, tgt, backward=True)
    assert measured == pytest.approx(training_flops(model.args, B, S, T), rel=0.05)
    assert counted(model, src, tgt, backward=False) == pytest.approx(forward_flops(model.args, B, S, T), rel=0.05)
    # The formula tells source from target length (cross-attention and generator are asymmetric).
    assert training_flops(model.args, B, T, S) != training_flops(model.args, B, S, T)


def test_flops_count_encoder_and_decoder_depths_apart():
    """model.N_dec: N encoder and N_dec decoder layers, each counted with its own layer's products."""
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=3, N_dec=1, d_model=64, d_ff=96, h=4), 50, 70)
    assert (len(model.encoder), len(model.decoder)) == (3, 1)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 70, (3, 9))
    assert counted(model, src, tgt, backward=True) == pytest.approx(training_flops(model.args, 3, 7, 9), rel=0.05)
    mirrored = Transformer.from_config(ModelConfig(N=1, N_dec=3, d_model=64, d_ff=96, h=4), 50, 70).args
    assert training_flops(mirrored, 3, 7, 9) > training_flops(model.args, 3, 7, 9)  # a decoder layer costs more


def test_step_flops_sum_the_micro_batches():
    args = Transformer.from_config(ModelConfig(N=1, d_model=32, d_ff=64, h=2), 20, 30).args
    shapes = [(4, 10, 12), (8, 5, 6)]
    assert step_flops(args, shapes) == training_flops(args, 4, 10, 12) + training_flops(args, 8, 5, 6)
    # Paper base, one pair of 25 tokens a side, by parameter counting: 6 FLOPs per weight per token with
    # 18.9M encoder weights on the source, 25.2M decoder + 18.9M generator (37000 x 512) weights on the
    # target: 6 * 25 * 63M = 9.45 GFLOPs, plus the attention scores (2%).
    base = ModelArgs(N=6, N_dec=6, d_model=512, d_ff=2048, h=8, dropout=0.1, norm_first=False, tie_embeddings="all",
                     max_positions=1024, src_vocab_size=37000, tgt_vocab_size=37000, shared_vocab=True)
    assert 9.45e9 < training_flops(base, 1, 25, 25) < 9.45e9 * 1.03
