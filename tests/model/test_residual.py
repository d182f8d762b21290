"""trainer.bf16_residual (transformer/model/residual.py): under bf16 autocast the residual stream is stored in
bf16 with sums and LayerNorm statistics in fp32; the loss stays that of the fp32 model, and the functions
trace as one graph for torch.compile to fuse."""
import pytest
import torch

from tests.helpers.composed import small_trainer as make_trainer  # composed once a process
from transformer.config import ModelConfig
from transformer.model import ModelOptions, Transformer
from transformer.specials import PAD
from transformer.training.components.loss import label_smoothed_cross_entropy


def make(norm_first: bool, dropout: float = 0.0, N: int = 2, on: bool = False) -> Transformer:
    """The same weights (seed 0) with the bf16 stream on or off."""
    torch.manual_seed(0)
    cfg = ModelConfig(N=N, d_model=64, d_ff=128, h=4, dropout=dropout, norm_first=norm_first)
    return Transformer.from_config(cfg, 40, 40, True, options=ModelOptions(bf16_residual=on))


def batch():
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(4, 40, (6, 11), generator=g), torch.randint(4, 40, (6, 9), generator=g)
    src[2, 6:] = PAD
    tgt[4, 5:] = PAD
    return src, tgt


def loss_of(model, amp: bool, seed: int = 1) -> torch.Tensor:
    src, tgt = batch()
    torch.manual_seed(seed)  # the same dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(src, tgt[:, :-1])
    loss, _ = label_smoothed_cross_entropy(logits, tgt[:, 1:], 0.1, PAD)
    return loss / (tgt[:, 1:] != PAD).sum()


@pytest.mark.parametrize("norm_first", [False, True])
def test_loss_within_tolerance_of_fp32(norm_first):
    """Small model, dropout 0.1 (same masks): the bf16-stream loss is within 1% of the fp32 loss, as close as
    bf16 autocast without the switch is (bf16 products round either way)."""
    model, on = make(norm_first, dropout=0.1).train(), make(norm_first, dropout=0.1, on=True).train()
    fp32 = loss_of(model, amp=False)
    plain, stream = loss_of(model, amp=True), loss_of(on, amp=True)
    assert abs(stream - fp32) / fp32 < 1e-2
    assert abs(stream - fp32) < 3 * abs(plain - fp32) + 1e-3
    stream.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in on.parameters())


@pytest.mark.parametrize("norm_first", [False, True])
def test_stream_is_bf16_only_under_bf16_autocast(norm_first):
    model, on = make(norm_first).eval(), make(norm_first, on=True).eval()
    dtypes = []
    for m in (model, on):
        m.encoder[0].register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    src, tgt = batch()
    for m in (model, on):
        loss_of(m, amp=True)
    assert dtypes == [torch.float32, torch.bfloat16]
    with torch.no_grad():  # without autocast the switch changes nothing, bit for bit
        assert torch.equal(on(src, tgt), model(src, tgt))


@pytest.mark.parametrize("norm_first", [False, True])
def test_traces_as_one_graph(norm_first):
    """fullgraph: a graph break would raise; the compiled forward equals the eager one. One layer of each kind
    (Dynamo traces every layer anew): its input is already the bf16 stream, the embeddings'."""
    model = make(norm_first, N=1, on=True).eval()
    src, tgt = batch()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(src, tgt), model(src, tgt))


def test_trainer_switch(tmp_path):
    t = make_trainer(tmp_path, "trainer.bf16_residual=true")
    assert all(m.bf16_residual for m in t.model.modules() if hasattr(m, "bf16_residual"))
    assert not make_trainer(tmp_path / "off").model.encoder[0].sub1.bf16_residual


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_compiled_bf16_stream_matches_fp32(norm_first):
    """On a GPU, torch.compile (inductor: dropout, add and LayerNorm fused): the bf16-stream loss is within 1%
    of the fp32 loss with P_drop 0, and its gradients are finite."""
    model = make(norm_first).cuda().train()
    src, tgt = (t.cuda() for t in batch())
    with torch.no_grad():
        ref, _ = label_smoothed_cross_entropy(model(src, tgt[:, :-1]), tgt[:, 1:], 0.1, PAD)
    model = make(norm_first, on=True).cuda().train()  # the same weights
    compiled = torch.compile(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = label_smoothed_cross_entropy(compiled(src, tgt[:, :-1]), tgt[:, 1:], 0.1, PAD)
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-2
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("norm_first", [False, True])
def test_compiled_layer_saves_the_stream_in_bf16(norm_first):
    """Under torch.compile (inductor, here on the CPU: the partitioner that picks what the backward reads is the
    GPU's) an encoder layer saves the stream for LayerNorm's backward in bf16, never an fp32 (B, T, d_model)
    tensor: post-norm rounds the sum to the stream's dtype before normalising, as pre-norm's stream already is,
    so the backward recomputes the normalised input from a bf16 tensor instead of reading it back in fp32."""
    from benchmarks.saved_activations import saved_bytes
    from transformer.model.layers import EncoderLayer

    torch.manual_seed(0)
    layer = EncoderLayer(64, 128, 4, 0.1, norm_first, bf16_residual=True)
    compiled = torch.compile(lambda x: layer(x, None))
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)  # (B, T, d_model)
    outs = []
    by = saved_bytes(lambda src, tgt: outs.append(compiled(src)) or outs[-1], x, None)  # runs the backward too
    assert outs[0].dtype == torch.bfloat16
    stream = [dtype for dtype, shape in by if shape == tuple(x.shape) and getattr(torch, dtype).is_floating_point]
    assert stream and all(dtype == "bfloat16" for dtype in stream), stream
    assert torch.isfinite(x.grad).all()


def bf16_round_trips(module, *inputs) -> list:
    """The shapes of the fp32 -> bf16 -> fp32 cast pairs in `module`'s traced training forward under bf16
    autocast, as inductor receives it (its decompositions applied, none of its passes). torch 2.11's inductor
    folds each such pair into the fp32 tensor, so the bf16 one is never stored or saved."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    casts = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
    found = []

    def cast_to(node):
        if node.op == "call_function" and node.target in casts:
            return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        return None

    def forward(gm, example_inputs):
        for node in gm.graph.nodes:
            inner = node.args[0] if node.args else None
            if cast_to(node) == torch.float32 and isinstance(inner, torch.fx.Node) and \
                    cast_to(inner) == torch.bfloat16 and inner.args[0].meta["val"].dtype == torch.float32:
                found.append(tuple(node.meta["val"].shape))
        return gm

    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=forward, decompositions=select_decomp_table()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(*inputs).float().sum().backward()
    return found


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_stream_never_casts_to_bf16_and_back(norm_first):
    """Each sum of the stream is a bf16 tensor in the traced graph, not an fp32 one cast to bf16 and back for the
    next LayerNorm or residual add: that pair, which torch 2.11's inductor folds (the lent H200s' release: it saved
    every post-norm sublayer's normalised input in fp32 again, `benchmarks/saved_activations.py`), appears nowhere
    in an encoder or a decoder layer's forward."""
    from transformer.model.layers import DecoderLayer, EncoderLayer

    torch.manual_seed(0)
    enc = EncoderLayer(64, 128, 4, 0.1, norm_first, bf16_residual=True)
    dec = DecoderLayer(64, 128, 4, 0.1, norm_first, bf16_residual=True)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)  # (B, T, d_model)
    k, v = (torch.randn(4, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))  # (B, h, S, d_k)
    assert bf16_round_trips(lambda x: enc(x, None), x) == []
    assert bf16_round_trips(lambda x, k, v: dec(x, (k, v), None), x, k, v) == []
