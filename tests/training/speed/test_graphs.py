"""Static batch shapes (trainer.static_shapes) and the CUDA-graph step (trainer.cuda_graphs): the padding is
invisible to the loss and the gradients, an epoch needs few shapes, the graph-safe step (device token count,
capturable Adam with a device learning rate, static gradient buffers) equals the ordinary step when run
eagerly on the CPU, checkpoints cross between the two, and what cannot work is refused in one line. The
CUDA-only part (capture and replay) is in the gpu tests at the end."""
import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.composed import composed, small_trainer
from tests.helpers.numerics import tolerance
from tests.training.loop.test_trainer import ragged_pairs
from transformer.config import ConfigError
from transformer.config_checks import validate
from transformer.data.batch import PAD, collate
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shapes import pad_to_shape, shape_length, static_shape
from transformer.model import Transformer
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.loop.hotpath import LaggedFlag, TrainWindow
from transformer.training.speed.graphs import check_cuda_graphs

FP32 = ("trainer.precision=fp32",)


def test_the_length_ladder_pads_by_at_most_3_up_to_32_and_by_under_a_quarter_above():
    ladder = sorted({shape_length(n) for n in range(1, 1025)})
    assert ladder[:18] == [4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192]
    assert len(ladder) == 8 + 4 * 5  # four steps an octave from 32 to 1024
    for n in range(1, 1025):
        L = shape_length(n)
        assert L >= n and L % 4 == 0 and (L - n <= 3 if n <= 32 else L < 1.25 * n)
        assert shape_length(L) == L  # a ladder length is its own shape


@pytest.mark.parametrize("steps,fine,top", [(2, 8, 1.5), (8, 2, 1.125), (16, 1, 1.0625)])
def test_finer_ladders_pad_less_and_keep_their_octave_steps(steps, fine, top):
    """trainer.shape_steps: `steps` lengths an octave; multiples of 32 / (2 steps) up to 32, above it under a
    (2 steps)-th of the length; every ladder of the coarser one is also on the finer one."""
    ladder = sorted({shape_length(n, steps) for n in range(1, 1025)})
    assert len(ladder) == 32 // fine + steps * 5
    for n in range(1, 1025):
        L = shape_length(n, steps)
        assert L >= n and L % fine == 0 and (L - n < fine if n <= 32 else L < top * n)
        assert shape_length(L, steps) == L
    if steps > 2:
        assert {shape_length(n, steps // 2) for n in range(1, 1025)} <= set(ladder)
    assert shape_length(33, 8) == 36 and shape_length(13, 8) == 14 and shape_length(13, 16) == 13
    with pytest.raises(ValueError, match="trainer.shape_steps=3"):
        shape_length(10, 3)


def _grads(model, src, tgt_in, tgt_out):
    model.zero_grad(set_to_none=True)
    loss, nll = label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, 0.1, PAD)
    loss.backward()
    return loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_batch_padded_to_its_static_shape_has_the_same_loss_gradients_and_tokens():
    """Rows of </s> alone with <pad> targets, and lengths padded with <pad>: no NaN (each dummy source row has
    one real key), the same loss, nll and gradient as the unpadded batch (fp32; only summation order differs),
    the same target token count."""
    ds = ragged_pairs(7, seed=5)
    batch = collate([ds[i] for i in range(7)])
    torch.manual_seed(0)
    model = Transformer.from_config(compose_cfg("experiment=copy", "model.N=2", "model.d_model=32", "model.d_ff=64",
                                                "model.h=2", "model.dropout=0.0").model, 11, 11, True)
    S, T = batch.src.size(1), batch.tgt_in.size(1)
    shape = static_shape(S + 1, T + 1, budget=200)  # one ladder step up: both lengths get padding too
    assert shape[0] > len(batch) and shape[1] > S and shape[2] > T  # several dummy rows
    padded = pad_to_shape(batch.src, batch.tgt_in, batch.tgt_out, shape)
    assert [tuple(t.shape) for t in padded] == [shape[:2], (shape[0], shape[2]), (shape[0], shape[2])]
    assert int((padded[2] != PAD).sum()) == batch.n_tokens == int((batch.tgt_out != PAD).sum())
    assert (padded[0][len(batch):, 0] == 3).all() and (padded[0][len(batch):, 1:] == PAD).all()  # </s> alone
    for dtype in (torch.float64, torch.float32):  # equal but for rounding
        tol = tolerance(dtype, shape[0] * max(shape[1:]))  # the longest sums: a weight's gradient over the rows
        model.to(dtype)
        loss, nll, grads = _grads(model, batch.src, batch.tgt_in, batch.tgt_out)
        loss_p, nll_p, grads_p = _grads(model, *padded)
        assert torch.isfinite(loss_p) and all(torch.isfinite(g).all() for g in grads_p)
        torch.testing.assert_close(loss_p, loss, rtol=tol, atol=0)
        torch.testing.assert_close(nll_p, nll, rtol=tol, atol=0)
        for g, gp in zip(grads, grads_p, strict=True):
            assert float((gp - g).norm()) <= tol * float(g.norm())
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_shape(batch.src, batch.tgt_in, batch.tgt_out, (len(batch) - 1, S, T))


def multi30k_like_sizes(n=29000, seed=0):
    """Multi30k's training split: 29,000 pairs of about 13 +- 5 tokens a side (plus the special token)."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.normal(14, 5, n)), 2, 60).astype(np.int64)
    tgt = np.clip(np.round(src * rng.normal(1.0, 0.15, n)), 2, 60).astype(np.int64)
    return src + 1, tgt + 1


def static_epoch(budget: int, steps: int):
    """(batches, shapes, padding share) of one epoch of Multi30k-like lengths with static shapes of `steps`."""
    src, tgt = multi30k_like_sizes()
    batches = TokenBatchSampler(src, tgt, budget, seed=1, static_shapes=True, shape_steps=steps).epoch_batches(0)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(src)))  # every pair once
    shapes = [static_shape(int(src[b].max()), int(tgt[b].max()), budget, steps=steps) for b in batches]
    for b, (R, S, T) in zip(batches, shapes, strict=True):
        assert len(b) <= R and R * max(S, T) <= budget  # padded, the batch still fits the budget
    return batches, shapes, 1 - int(src.sum() + tgt.sum()) / sum(R * (S + T) for R, S, T in shapes)


@pytest.mark.parametrize("budget", [2048, 4096])
def test_an_epoch_of_static_shapes_uses_few_shapes_within_the_token_budget(budget):
    src, tgt = multi30k_like_sizes()
    plain = TokenBatchSampler(src, tgt, budget, seed=1)
    batches, shapes, padding = static_epoch(budget, 4)
    distinct = set(shapes)
    assert len(distinct) <= 24, sorted(distinct)
    assert padding < 0.2  # under a fifth of the computed positions are padding (the coarser ladder: 0.2)
    assert len(batches) < 1.2 * len(plain.epoch_batches(0))  # batches hold fewer pairs, not far fewer
    # Eight steps an octave: less padding, more shapes, every batch still within the budget.
    _, finer, finer_padding = static_epoch(budget, 8)
    assert finer_padding < 0.75 * padding and len(distinct) < len(set(finer)) <= 3 * len(distinct)


@pytest.mark.parametrize("steps", [4, 16])
def test_trainer_static_shapes_feed_only_static_shapes(tmp_path, monkeypatch, steps):
    from transformer.training.speed import speedups
    seen = []
    real = speedups.prepare_batch

    def spy(batch, *args):
        out = real(batch, *args)
        seen.append((tuple(out.src.shape), tuple(out.tgt_in.shape), int((out.tgt_out != PAD).sum()),
                     batch.n_tokens))
        return out
    monkeypatch.setattr(speedups, "prepare_batch", spy)
    t = small_trainer(tmp_path, *FP32, "trainer.static_shapes=true", "trainer.accumulate=2",
                      f"trainer.shape_steps={steps}", "data.copy.train_size=64")  # an epoch of 4 batches
    window, flag = TrainWindow(), LaggedFlag()
    epoch = list(t.data.train_loader(0))
    for i in range(0, len(epoch) - 1, 2):
        t._train_step(epoch[i:i + 2], window, flag)
    assert seen and all(tokens == n for _, _, tokens, n in seen)
    assert len({(s, tg) for s, tg, _, _ in seen}) == 1  # the copy task: one length, so one shape
    assert all(s[0] == 200 // max(s[1], tg[1]) and shape_length(s[1], steps) == s[1] for s, tg, _, _ in seen)


def graph_safe_trainer(tmp_path, *overrides, env=None, rank=0, world_size=1):
    """A trainer whose step is the graph-safe one run eagerly (trainer.cuda_graphs on a CPU: capturable fused
    Adam, the rate as a device tensor, flat static gradient buffers, device token count). parallelize refuses
    cuda_graphs on a CPU, so the model is wrapped as for static shapes, without DDP, as cuda_graphs wraps it."""
    from tests.training.loop.test_trainer import SMALL
    from transformer.data.copy import CopyData
    from transformer.dist import DistEnv
    from transformer.tasks import build_task
    from transformer.training.distributed.parallelize import build_model, parallelize
    from transformer.training.loop.trainer import Trainer
    env = env or DistEnv()
    cfg = composed(*SMALL, *FP32, "trainer.cuda_graphs=true", *overrides)
    data = CopyData(cfg, cfg.seed, rank, world_size)
    torch.manual_seed(0)
    model = build_model(cfg, data)
    parallel = parallelize(model, composed(*SMALL, *FP32, "trainer.static_shapes=true", *overrides), DistEnv())
    t = Trainer(cfg, env, parallel, data, build_task(cfg), tmp_path)
    whole = cfg.trainer.compile and cfg.trainer.compile_scope == "model"  # else net is the module itself
    assert t.graphs is not None and not t.graphs.capture and (t.net is t.model) != whole
    assert t.optimizer.param_groups[0]["capturable"] and torch.is_tensor(t.optimizer.param_groups[0]["lr"])
    return t


def graph_safe_pair(tmp_path, *overrides):
    """An ordinary trainer (static shapes) and a graph-safe one run eagerly, from the same weights."""
    return plain_static_trainer(tmp_path / "plain", *overrides), graph_safe_trainer(tmp_path / "g", *overrides)


def plain_static_trainer(tmp_path, *overrides):
    """The ordinary step on static shapes, from graph_safe_trainer's weights."""
    return small_trainer(tmp_path, *FP32, "trainer.static_shapes=true", *overrides)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "layers"])
def test_the_graph_safe_step_composes_with_compile_and_the_compiled_loss(tmp_path, scope):
    """make bench-gpu's `all` set on a CPU, without capture: the compiled model (whole, or each layer) and the
    compiled loss inside the graph-safe step give the ordinary compiled step's statistics and gradient norms."""
    plain, graphed = graph_safe_pair(tmp_path, "trainer.compile=true", f"trainer.compile_scope={scope}",
                                     "trainer.loss=compiled",
                                     "trainer.accumulate=2", "trainer.clip_norm=0.5", "model.dropout=0.0")
    steps = ragged_steps(3, 2)
    for ra, rb in zip(run(plain, steps), run(graphed, steps), strict=True):
        torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-5, atol=0)
        torch.testing.assert_close(rb.grad_norm, ra.grad_norm, rtol=1e-4, atol=0)


def ragged_steps(n_steps, k, seed=3):
    ds = ragged_pairs(n_steps * k * 6, seed=seed)
    micro = [collate([ds[i] for i in range(j, j + 6)]) for j in range(0, len(ds), 6)]
    return [micro[i:i + k] for i in range(0, len(micro), k)]


def run(t, steps):
    window, flag = TrainWindow(), LaggedFlag()
    return [t._train_step(m, window, flag)[0] for m in steps]


@pytest.mark.parametrize("model", [(), ("model.tie_embeddings=all", "model.norm_first=false")],
                         ids=["default", "multi30k_model"])
def test_the_graph_safe_step_run_eagerly_equals_the_ordinary_step(tmp_path, model):
    """accumulate=2 with ragged micro-batches, dropout on, clipping on, over 5 steps: the same statistics, gradient
    norms, learning rates, weights and Adam moments (fp32; the only differences are the rate's float32
    tensor and the token count summed on the device). Also with experiment=multi30k's model options: all three
    embeddings tied (one parameter, one gradient buffer) and post-norm."""
    plain, graphed = graph_safe_pair(tmp_path, "trainer.accumulate=2", "trainer.clip_norm=0.5",
                                     "optim.warmup=2", "optim.factor=0.1", *model)
    steps = ragged_steps(5, 2)
    torch.manual_seed(7)
    a = run(plain, steps)
    torch.manual_seed(7)
    b = run(graphed, steps)
    for ra, rb in zip(a, b, strict=True):
        torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-6, atol=0)
        torch.testing.assert_close(rb.grad_norm, ra.grad_norm, rtol=1e-5, atol=0)
    assert float(graphed.optimizer.param_groups[0]["lr"]) == pytest.approx(plain.scheduler.lr(), rel=1e-6)
    initial = fresh_weights(graphed)
    moved = 0.0
    for (name, p), q in zip(plain.model.named_parameters(), graphed.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        sa, sb = plain.optimizer.state[p], graphed.optimizer.state[q]
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=1e-4, atol=1e-8)
        assert float(sb["step"]) == float(sa["step"]) == 5
        moved = max(moved, float((p.detach() - initial[name]).abs().max()))
    assert moved > 1e-4  # the weights did move: the comparison compares something
    assert all(float(g.abs().max()) == 0 for g in graphed.graphs.grads)  # zeroed for the next step


def fresh_weights(t) -> dict:
    torch.manual_seed(0)
    fresh = Transformer.from_config(t.cfg.model, t.data.src_vocab_size, t.data.tgt_vocab_size, t.data.shared_vocab)
    return {name: p.detach() for name, p in fresh.named_parameters()}


def test_the_graph_safe_step_reads_nothing_on_the_host(tmp_path):
    """What a CUDA graph needs: no device value read on the host in the step (token count, rate, Adam's step
    counters and the non-finite skip stay on the device), checked eagerly on the CPU with test_hotpath's
    dispatch spy, nothing exempt."""
    from tests.training.loop.test_hotpath import HostReadSpy
    t = graph_safe_trainer(tmp_path, "trainer.clip_norm=1.0", "trainer.accumulate=2")
    steps = ragged_steps(4, 2)
    window, flag = TrainWindow(), LaggedFlag()
    t._train_step(steps[0], window, flag)  # creates Adam's state
    with HostReadSpy() as s:
        for m in steps[1:]:
            result, stop = t._train_step(m, window, flag)
    assert s.seen == [] and stop is False
    assert all(isinstance(v, torch.Tensor) for v in (result.tokens, result.loss, result.grad_norm))


def _worker(rank: int, port: int, out: str):
    from tests.helpers.dist import join_gloo
    from transformer import dist
    torch.set_num_threads(1)
    env = join_gloo(rank, 2, port)
    try:
        t = graph_safe_trainer(Path(out) / f"r{rank}", "trainer.clip_norm=0.5", "optim.factor=0.1", env=env,
                               rank=rank, world_size=2)
        torch.manual_seed(7)
        results = run(t, [[m[rank]] for m in ragged_steps(3, 2)])  # rank r: micro-batch r of each step
        torch.save({"weights": [p.detach() for p in t.model.parameters()],
                    "stats": [r.stats for r in results]}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.close()


@pytest.mark.distributed
def test_two_graph_safe_workers_equal_one_with_accumulate_2(tmp_path):
    """The graph-safe step all-reduces its flat gradient buffer itself (no DDP): 2 gloo workers taking one
    micro-batch each give the statistics and weights of 1 worker with trainer.accumulate=2 (fp32 sums in
    another order), and the two replicas stay identical."""
    import torch.multiprocessing as mp

    from tests.helpers.cli import free_port
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    one = graph_safe_trainer(tmp_path / "one", "trainer.clip_norm=0.5", "optim.factor=0.1", "trainer.accumulate=2")
    torch.manual_seed(7)
    results = run(one, ragged_steps(3, 2))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert torch.equal(a, b)
    for r, got in zip(results, ranks[0]["stats"], strict=True):
        torch.testing.assert_close(got[:3], r.stats[:3], rtol=1e-6, atol=0)
    for p, q in zip(one.model.parameters(), ranks[0]["weights"], strict=True):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)


def test_graph_safe_checkpoints_resume_exactly_and_cross_with_the_ordinary_step(tmp_path):
    """2 + 2 steps through a checkpoint equal 4 steps (bitwise), for a checkpoint of the graph-safe step
    loaded by the graph-safe step and by the ordinary one, and the other way round."""
    steps = ragged_steps(4, 2, seed=11)
    overrides = ("trainer.accumulate=2", "trainer.clip_norm=1.0")

    def trainer(path, graphed):
        return graph_safe_trainer(path, *overrides) if graphed else plain_static_trainer(path, *overrides)
    whole = trainer(tmp_path / "w", True)
    torch.manual_seed(3)
    run(whole, steps)
    for writer_graphed in (True, False):
        writer = trainer(tmp_path / f"a{writer_graphed}", writer_graphed)
        torch.manual_seed(3)
        run(writer, steps[:2])
        state = writer.state_dict()
        for reader_graphed in (True, False):
            reader = trainer(tmp_path / f"b{writer_graphed}{reader_graphed}", reader_graphed)
            reader.load_state_dict(copy.deepcopy(state))  # each reader its own checkpoint, as from a file
            assert torch.is_tensor(reader.optimizer.param_groups[0]["lr"]) == reader_graphed
            run(reader, steps[2:])
            for p, q in zip(whole.model.parameters(), reader.model.parameters(), strict=True):
                if writer_graphed and reader_graphed:
                    assert torch.equal(p, q)
                else:  # the ordinary step differs from the graph-safe one by rounding (test above)
                    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, conflict", [
    (("trainer.activation_checkpointing=true",), "trainer.activation_checkpointing=true"),
    (("trainer.precision=fp16",), "trainer.precision=fp16"),
])
def test_cuda_graphs_refuses_what_it_cannot_capture(overrides, conflict):
    cfg = compose_cfg("experiment=copy", "trainer.cuda_graphs=true", *overrides)
    with pytest.raises(ConfigError, match=r"^trainer.cuda_graphs=true: not with " + conflict):
        validate(cfg)


def test_cuda_graphs_refuses_a_cpu():
    tcfg = compose_cfg("experiment=copy", "trainer.cuda_graphs=true").trainer
    with pytest.raises(ConfigError, match=r"^trainer.cuda_graphs=true: needs a CUDA device, this run is on cpu"):
        check_cuda_graphs(tcfg, torch.device("cpu"))
    check_cuda_graphs(tcfg, torch.device("cuda", 0))  # accepted


def test_the_graph_step_refuses_parameters_of_two_dtypes():
    """One flat gradient buffer holds every gradient, so the parameters must share a dtype: a half-converted
    model is refused before any buffer is made."""
    from transformer.training.speed.graphs import GraphStep
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="one flat buffer: parameters of one dtype"):
        GraphStep(model, model, None, None, None, None, None, capture=False)


def test_cuda_graphs_on_a_cpu_is_one_error_line_and_exit_code_2(tmp_path, capfd):
    """transformer-train's main() in this process (test_contract.py starts the command as a process)."""
    from tests.helpers.inprocess import call_main
    from transformer.cli import train as train_cli
    res = call_main(train_cli.main, ["experiment=copy", "trainer.cuda_graphs=true", "trainer.accelerator=cpu",
                                     "trainer.max_steps=1", f"hydra.run.dir={tmp_path}/run"], tmp_path,
                    prog="transformer-train", capture=capfd)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: trainer.cuda_graphs=true: needs a CUDA device, this run is on cpu; set speed=eager or "
                      "trainer.cuda_graphs=false (trainer.static_shapes=true alone works everywhere)"], res.stderr


def test_bench_counts_static_shape_padding_as_waste(tmp_path):
    """transformer-bench with trainer.static_shapes: the padding to the static shapes (rows and lengths) is
    counted as waste, never as useful work, and the batches take a handful of shapes."""
    from tests.helpers.inprocess import bench_in_process
    from tests.training.tools.test_bench import TINY, record
    plain = record(bench_in_process(tmp_path, *TINY, "trainer.precision=fp32", "bench.profile=false"))
    static = record(bench_in_process(tmp_path, *TINY, "trainer.precision=fp32", "bench.profile=false",
                                     "trainer.static_shapes=true"))
    assert plain["waste_pad_multiple"] == 0 and not plain["static_shapes"]
    assert static["static_shapes"] and 0 < static["waste_pad_multiple"] < 0.6
    assert 1 <= static["shapes"] <= 4 < plain["shapes"]  # lengths 2..41: the ladder's 8..48
    assert static["flops_per_step"] < static["flops_computed_per_step"]


def test_totals_count_the_static_shape_a_batch_runs_at():
    from transformer.config import ModelConfig
    from transformer.data.batch import Batch
    from transformer.model.flops import training_flops
    from transformer.training.tools.bench import Totals
    args = Transformer.from_config(ModelConfig(N=1, d_model=16, d_ff=32, h=2), 50, 70).args
    src, tgt = torch.tensor([[7, 8, 2, 0, 0], [7, 8, 9, 10, 2]]), torch.tensor([[1, 9, 0, 0], [1, 9, 10, 11]])
    totals = Totals(args, 1, shape_of=lambda b: static_shape(b.src.size(1), b.tgt_in.size(1), 64))
    totals.add([Batch(src, tgt, tgt, torch.arange(2), 6)], 0.0)
    totals.tally()
    assert totals.shapes == {(8, 8, 4)}  # lengths 5 and 4 on the ladder: 8 and 4; rows 64 // 8
    assert totals.flops_run == training_flops(args, 8, 8, 4) > totals.flops_batch == training_flops(args, 2, 5, 4)


# ---- GPU: capture and replay (skipped without CUDA) ------------------------------------------------------------
def gpu_pair(tmp_path, *overrides):
    """Two trainers on the GPU from the same weights: static shapes eager, and static shapes as CUDA graphs."""
    from tests.tiers.test_gpu import make_trainer as gpu_trainer
    # true fp32 products, not TF32 (trainer.tf32's default): the tolerances below are fp32 rounding's
    common = ("trainer.accumulate=2", "trainer.clip_norm=1.0", "optim.factor=0.1", "trainer.tf32=false", *overrides)
    return (gpu_trainer(tmp_path / "eager", "fp32", "trainer.static_shapes=true", *common),
            gpu_trainer(tmp_path / "graphs", "fp32", "trainer.cuda_graphs=true", *common))


def pinned_steps(n, seed=3):
    """Ragged micro-batches of several static shapes, in pinned memory (as the GPU loaders give them)."""
    return [[b.pin_memory() for b in m] for m in ragged_steps(n, 2, seed)]


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [("model.dropout=0.0",), ("model.dropout=0.1",),
                                     ("model.dropout=0.1", "model.attention_dropout=0")],
                         ids=["0.0", "0.1", "0.1+attention0"])
def test_cuda_graph_replay_equals_the_eager_step(tmp_path, dropout):
    """6 steps of accumulate=2 over ragged micro-batches of several shapes: statistics, gradient norms and weights
    of the replayed graphs equal the eager step's (fp32; Adam's capturable form and float32 rate differ by
    rounding). With dropout, the graphs draw the masks the eager kernels draw (same CUDA RNG offsets).
    "0.1+attention0" drops on the sublayers only: if it passes where "0.1" fails, the attention kernel's own
    dropout (its mask drawn again in the backward) is what differs under capture."""
    eager, graphed = gpu_pair(tmp_path, *dropout)
    assert_replay_equals_eager(eager, graphed, pinned_steps(6))
    assert len(graphed.graphs.micro) >= 2


def assert_replay_equals_eager(eager, graphed, steps):
    """The same steps, the same CUDA seed: statistics, gradient norms and weights of the replayed graphs equal
    the eager step's (fp32)."""
    torch.cuda.manual_seed(5)
    a = run(eager, steps)
    torch.cuda.manual_seed(5)
    b = run(graphed, steps)
    assert graphed.graphs.capture and graphed.graphs.micro and graphed.graphs.update_graph is not None
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):  # the step is named: the first has equal weights
        def named(m, i=i):
            return f"step {i}: {m}"
        torch.testing.assert_close(rb.stats, ra.stats, rtol=1e-5, atol=0, msg=named)
        torch.testing.assert_close(rb.grad_norm, ra.grad_norm, rtol=1e-4, atol=0, msg=named)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_steps_make_no_host_sync(tmp_path):
    from transformer.training.tools.profiling import host_syncs
    _, graphed = gpu_pair(tmp_path)
    steps = pinned_steps(8)
    window, flag = TrainWindow(), LaggedFlag()
    for m in steps[:4]:  # every shape captured, the update graph too
        graphed._train_step(m, window, flag)
    syncs = host_syncs(lambda: [graphed._train_step(m, window, flag) for m in steps[:4]])
    assert syncs == [], syncs


@pytest.mark.gpu
def test_cuda_graphs_resume_exactly_with_dropout(tmp_path):
    """4 steps equal 2 steps, a checkpoint, and 2 steps in a new trainer that captures its graphs anew:
    weights bitwise, dropout included (the CUDA RNG state in the checkpoint stays exact under replay)."""
    steps = pinned_steps(4, seed=9)
    _, whole = gpu_pair(tmp_path / "w", "model.dropout=0.1")
    torch.cuda.manual_seed(1)
    run(whole, steps)
    _, first = gpu_pair(tmp_path / "a", "model.dropout=0.1")
    torch.cuda.manual_seed(1)
    run(first, steps[:2])
    state = first.state_dict()
    _, second = gpu_pair(tmp_path / "b", "model.dropout=0.1")
    second.load_state_dict(state)
    run(second, steps[2:])
    for p, q in zip(whole.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
