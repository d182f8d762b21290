"""trainer.compile_scope=layers (transformer/experimental/regional_compile.py): torch.compile per encoder and
decoder layer. Two graphs for any N and any batch shape, the same numbers as the eager model, and only the
training forward compiled: validation and incremental decoding stay eager."""
import pytest
import torch

from transformer.config import ModelConfig
from transformer.decoding.search import greedy_decode
from transformer.experimental import regional_compile
from transformer.model import Transformer
from transformer.specials import PAD
from transformer.training.speed import speedups


def make() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(N=3, d_model=32, d_ff=64, h=2, dropout=0.0)
    return Transformer.from_config(cfg, 40, 40, False)


def batch(rows: int, S: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, 40, (rows, S), generator=g), torch.randint(4, 40, (rows, T), generator=g)
    src[1, S // 2:] = PAD  # padding, so the source mask matters
    return src, tgt


def graphs() -> int:
    return speedups.compiled_graphs()


@pytest.mark.slow
def test_layer_compiled_model_equals_eager_in_two_graphs_and_decodes_eagerly():
    torch._dynamo.reset()
    eager, compiled = make(), make()
    regional_compile.compile_layers(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints unchanged
    before = graphs()
    for rows, S, T, seed in ((4, 9, 7, 1), (6, 13, 11, 2), (3, 5, 12, 3)):
        src, tgt = batch(rows, S, T, seed)
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            logits = model(src, tgt)  # (rows, T, V)
            logits.float().square().mean().backward()
            outs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        (a, ga), (b, gb) = outs
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        for x, y in zip(gb, ga, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)
    # one encoder layer graph and one decoder layer graph served all N=3 layers and all three shapes
    assert graphs() - before == 2
    compiled.eval()
    with torch.no_grad():
        src, _ = batch(2, 8, 3, 4)
        assert greedy_decode(compiled, src, 1.0, 5) == greedy_decode(eager.eval(), src, 1.0, 5)
        compiled(src, src)  # validation's loss: no gradients, eager
    assert graphs() - before == 2
