"""Packed token budgets (transformer/experimental/packed.py): trainer.static_shapes or trainer.cuda_graphs with
trainer.unpadded_attention. The packed batch's layout, its forward against the padded model's, the sampler that
fills the budgets, and the trainer, the graph-safe step and the benchmark on such batches."""
import numpy as np
import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.composed import small_trainer
from tests.helpers.numerics import assert_close_scaled
from tests.training.speed.test_graphs import FP32, assert_replay_equals_eager, graph_safe_trainer, run
from transformer.config import ModelConfig
from transformer.config_checks import validate
from transformer.data.batch import collate
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shapes import shape_length
from transformer.experimental import packed
from transformer.model import ModelOptions, Transformer
from transformer.specials import EOS, PAD
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.loop.hotpath import LaggedFlag, TrainWindow


def varied_items(n=7, seed=0, longest=12):
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(4, 30, rng.integers(1, longest)).astype(np.int32),
             rng.integers(4, 30, rng.integers(1, longest + 3)).astype(np.int32)) for i in range(n)]


@pytest.mark.parametrize("cap", [100, 200, 4096])
def test_a_packed_batch_fills_a_ladder_budget_with_filler_pairs(cap):
    items = varied_items()
    b = packed.collate(items, cap)
    sp, tp = b.packings
    n_src = sum(len(s) + 1 for _, s, _ in items)
    n_tgt = sum(len(t) + 1 for _, _, t in items)
    N_s, N_t = b.src.size(0), b.tgt_in.size(0)
    assert (N_s, N_t) == (packed.budget(n_src, cap), packed.budget(n_tgt, cap))
    assert N_s >= n_src + packed.reserve(cap) and N_t >= n_tgt + packed.reserve(cap)
    assert N_s == min(shape_length(n_src + packed.reserve(cap)), cap)
    assert b.n_tokens == n_tgt == int((b.tgt_out != PAD).sum()) and len(b) == len(items)
    # both sides: the same sentence slots, their lengths adding up to the budget, filler pairs non-empty
    B = len(items)
    assert sp.B == tp.B == len(sp.lengths) == len(tp.lengths) and sp.cu_seqlens.numel() == sp.B + 1
    sentences = int(((sp.lengths > 0) | (tp.lengths > 0)).sum())
    assert sp.B == 1 << (sentences - 1).bit_length()  # a power of two
    assert int(sp.lengths.sum()) == N_s and int(tp.lengths.sum()) == N_t
    filler = (sp.lengths[B:] > 0) | (tp.lengths[B:] > 0)
    assert bool(((sp.lengths[B:] > 0) == (tp.lengths[B:] > 0)).all()) and int(filler.sum()) >= 1
    assert bool((b.src[n_src:] == EOS).all()) and bool((b.tgt_out[n_tgt:] == PAD).all())
    # positions: each sentence counts from 0, within the width T
    for p, n in ((sp, N_s), (tp, N_t)):
        assert p.index.numel() == n and int(p.index.max()) < p.B * p.T and p.max_len == p.T
        assert p.T >= int(p.lengths.max()) and p.T == shape_length(p.T)
        pos = (p.index % p.T).tolist()
        starts = set(p.cu_seqlens[:-1].tolist())
        assert all(pos[j] == 0 if j in starts else pos[j] == pos[j - 1] + 1 for j in range(n))
    assert packed.shape_of(b) == (sp.B, N_s, N_t, sp.T, tp.T)


def test_widths_make_every_batch_as_wide_as_the_split_s_longest_sentence():
    a, b = packed.collate(varied_items(seed=1), 4096, widths=(40, 50)), packed.collate(varied_items(seed=2), 4096)
    assert (a.packings[0].T, a.packings[1].T) == (40, 56)  # on the ladder: 40, then 56 for 50
    assert b.packings[0].T < 40 and b.packings[1].T < 56  # without: each batch's own longest


def test_filler_pairs_cover_both_sides_with_a_token_each():
    for f_src, f_tgt in [(1, 1), (1, 500), (500, 1), (3, 200), (130, 129), (64, 64), (65, 7)]:
        s, t = packed.filler_lengths(f_src, f_tgt)
        assert s.sum() == f_src and t.sum() == f_tgt and len(s) == len(t) and (s >= 1).all() and (t >= 1).all()
        if min(f_src, f_tgt) >= -(-max(f_src, f_tgt) // packed.FILLER):  # enough tokens: short pairs
            assert max(s.max(), t.max()) <= packed.FILLER


def test_a_batch_that_does_not_fit_its_cap_is_refused():
    with pytest.raises(ValueError, match=r"does not fit data.max_tokens=20 with its reserve of 1"):
        packed.collate(varied_items(), 20)


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_packed_forward_equals_the_padded_model_at_every_real_token(norm_first):
    """Logits, loss and every gradient of a packed, budget-filled batch (filler pairs and empty slots included)
    equal the padded model's on the same sentences (P_drop 0, fp32, the CPU reference attention)."""
    cfg = ModelConfig(N=2, N_dec=2, d_model=32, d_ff=64, h=4, dropout=0.0, norm_first=norm_first)
    items = varied_items(9)
    padded, flat = collate(items), packed.collate(items, 200, widths=(20, 30))
    assert flat.packings[0].B > len(items) + 1 and flat.packings[0].T > 12  # empty slots, wider than needed
    results = []
    for b, unpadded in ((padded, False), (flat, True)):
        torch.manual_seed(0)  # the same weights
        model = Transformer.from_config(cfg, 30, 30, True, options=ModelOptions(unpadded_attention=unpadded)).train()
        logits = model(b.src, b.tgt_in, packings=b.packings)
        loss, nll = label_smoothed_cross_entropy(logits, b.tgt_out, 0.1, PAD)
        loss.backward()
        real = logits[b.tgt_out != PAD].detach()  # (n_tgt, V), sentence after sentence in both layouts
        results.append((real, loss.detach(), nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, la, na, ga), (b, lb, nb, gb) = results
    assert flat.src.dim() == 1 and b.shape == a.shape
    n = max(padded.src.numel(), padded.tgt_in.numel())  # the longest sums: a weight's gradient over the rows
    assert_close_scaled(b, a, n)
    assert_close_scaled(lb, la, n)
    assert_close_scaled(nb, na, n)
    for name in ga:
        assert bool(gb[name].isfinite().all()), name
        assert_close_scaled(gb[name], ga[name], n, msg=name)


def sizes(n=3000, seed=1):
    rng = np.random.default_rng(seed)
    src = rng.integers(2, 40, n)
    return src, np.clip(src + rng.integers(-5, 6, n), 2, 45)


@pytest.mark.parametrize("budget, world", [(1024, 1), (2048, 2)])
def test_the_packed_sampler_fills_the_budget_with_real_tokens(budget, world):
    src, tgt = sizes()
    sampler = TokenBatchSampler(src, tgt, budget, seed=3, world_size=world, packed=True)
    batches = sampler.epoch_batches(0)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(src)))  # every example once
    limit = budget - packed.reserve(budget)
    assert all(src[b].sum() <= limit and tgt[b].sum() <= limit for b in batches)
    full = [max(src[b].sum(), tgt[b].sum()) / limit for b in batches]
    assert np.median(full) > 0.97  # cut by real tokens: the binding side nearly full
    padded = TokenBatchSampler(src, tgt, budget, seed=3, world_size=world).epoch_batches(0)
    assert len(batches) < len(padded)  # fewer, fuller batches than rows x longest length allows
    assert len(batches) % world == 0 and sampler.epoch_batches(0) is batches


def test_the_packed_sampler_refuses_a_budget_without_room_for_the_longest_example():
    src, tgt = sizes()
    longest = int(max(src.max(), tgt.max()))
    TokenBatchSampler(src, tgt, longest + 1, packed=True).check_packed()  # room for it and one filler token
    sampler = TokenBatchSampler(src, tgt, longest, packed=True)
    with pytest.raises(ValueError, match=rf"^data.max_tokens={longest} cannot hold the longest example \({longest} "):
        sampler.check_packed()


def test_static_shapes_with_unpadded_attention_trains_on_packed_budgets(tmp_path):
    """The trainer's loaders hand it packed batches of a few shapes, validation stays padded, and a run trains,
    validates and decodes."""
    t = small_trainer(tmp_path, "trainer.static_shapes=true", "trainer.unpadded_attention=true",
                      "trainer.max_steps=4", "trainer.max_epochs=null", "trainer.val_every=4")
    batches = list(t.data.train_loader(0))
    assert all(b.src.dim() == 1 and b.packings is not None for b in batches)
    assert len({packed.shape_of(b) for b in batches}) <= 4
    assert next(iter(t.data.valid_loader())).src.dim() == 2
    assert t._static_shape(batches[0]) is None and t.train() == 0


def test_validate_accepts_packed_budgets_with_cuda_graphs():
    for switch in ("trainer.static_shapes=true", "trainer.cuda_graphs=true"):
        validate(compose_cfg("experiment=copy", switch, "trainer.unpadded_attention=true"))


def packed_steps(t, n_steps, k):
    items = [t.data.train[i] for i in range(n_steps * k * 6)]
    cap = t.data.train_sampler.cap
    micro = [packed.collate(items[j:j + 6], cap) for j in range(0, len(items), 6)]
    return [micro[i:i + k] for i in range(0, len(micro), k)]


def test_the_graph_safe_step_on_packed_budgets_equals_the_ordinary_packed_step(tmp_path):
    """What trainer.cuda_graphs runs with unpadded attention, run eagerly on the CPU (its packings as graph
    inputs): the ordinary packed step's statistics and gradient norms over 4 steps of 2 micro-batches."""
    extra = ("trainer.unpadded_attention=true", "trainer.accumulate=2", "trainer.clip_norm=0.5", "model.dropout=0.0")
    plain = small_trainer(tmp_path / "plain", *FP32, "trainer.static_shapes=true", *extra)
    graphed = graph_safe_trainer(tmp_path / "g", *extra)
    steps = packed_steps(plain, 4, 2)
    for ra, rb in zip(run(plain, steps), run(graphed, steps), strict=True):
        torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-6, atol=0)
        torch.testing.assert_close(rb.grad_norm, ra.grad_norm, rtol=1e-5, atol=0)
    for p, q in zip(plain.model.parameters(), graphed.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_bench_counts_filler_as_waste_and_no_padding(tmp_path):
    from tests.helpers.inprocess import bench_in_process
    from tests.training.tools.test_bench import TINY, record
    r = record(bench_in_process(tmp_path, *TINY, "trainer.precision=fp32", "trainer.static_shapes=true",
                                "trainer.unpadded_attention=true", "bench.profile=false",
                                "bench.warmup=0", "bench.steps=2", "bench.repeats=1"))  # packed CPU steps are slow
    assert r["static_shapes"] and r["target_padding"] == 0 and r["waste_padding"] == 0
    assert 0 < r["waste_pad_multiple"] < 0.3 and 1 <= r["shapes"] <= 6


@pytest.mark.slow
def test_bench_compiled_packed_budgets_stop_compiling_after_warm_up(tmp_path):
    """torch.compile on packed budgets (as `make bench-gpu`'s all+unpadded runs them, less the GPU): after at most
    one recompilation (the budgets' sizes made dynamic) no batch compiles, and the filler stays a few percent."""
    from tests.training.tools.test_bench import TINY, bench, record
    r = record(bench(tmp_path, *TINY, "model.d_model=32", "model.d_ff=64", "model.h=2", "trainer.compile=true",
                     "trainer.static_shapes=true", "trainer.unpadded_attention=true", "model.dropout=0.0",
                     "trainer.precision=fp32", "data.max_tokens=2048", "bench.warmup=4", "bench.steps=4"))
    assert r["compile"] is True and r["graphs"] <= 2 and r["graphs_during_timed"] == 0
    assert r["shapes"] >= 2 and 0 < r["waste_pad_multiple"] < 0.1


# ---- GPU: packed budgets captured as CUDA graphs (skipped without CUDA) ------------------------------------------
def gpu_packed_pair(tmp_path, *overrides, precision="fp32"):
    """Packed budgets on the GPU from the same weights: eager (static_shapes) and replayed (cuda_graphs). No
    dropout on the attention weights: torch's varlen kernel has none (flash-attn's would). In fp32 (true fp32
    products, no TF32) attention runs the reference, the varlen kernels taking bf16 and fp16 only."""
    from tests.tiers.test_gpu import make_trainer as gpu_trainer
    common = ("trainer.unpadded_attention=true", "model.attention_dropout=0", "trainer.accumulate=2",
              "trainer.clip_norm=1.0", "optim.factor=0.1", "trainer.tf32=false", *overrides)
    return (gpu_trainer(tmp_path / "eager", precision, "trainer.static_shapes=true", *common),
            gpu_trainer(tmp_path / "graphs", precision, "trainer.cuda_graphs=true", *common))


def pinned_packed_steps(t, n):
    return [[b.pin_memory() for b in m] for m in packed_steps(t, n, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_graphs_on_packed_budgets_equal_the_eager_step(tmp_path, dropout):
    """6 steps of 2 packed micro-batches: the replayed graphs' statistics, gradient norms and weights equal the
    eager packed step's (fp32, so the re-padding reference attention), dropout on the sublayers included; the
    packings travel as graph inputs."""
    eager, graphed = gpu_packed_pair(tmp_path, f"model.dropout={dropout}")
    assert_replay_equals_eager(eager, graphed, pinned_packed_steps(eager, 6))


@pytest.mark.gpu
def test_cuda_graphs_on_packed_budgets_make_no_host_sync(tmp_path):
    """bf16: torch's varlen kernel (or flash-attn's) captured in the graphs, and no step reads a device value."""
    from transformer.training.tools.profiling import host_syncs
    _, graphed = gpu_packed_pair(tmp_path, precision="bf16")
    steps = pinned_packed_steps(graphed, 8)
    window, flag = TrainWindow(), LaggedFlag()
    for m in steps:  # every shape captured, the update graph too
        graphed._train_step(m, window, flag)
    syncs = host_syncs(lambda: [graphed._train_step(m, window, flag) for m in steps])
    assert syncs == [], syncs
