import math

import pytest
import torch

from transformer.training.components import loss as loss_module
from transformer.training.components.loss import label_smoothed_cross_entropy, reference_label_smoothed_cross_entropy
from transformer.training.components.optim import NoamSchedule, fall_steps, noam_lr


def test_noam_values_at_chosen_steps():
    d, w = 512, 4000
    assert noam_lr(1, d, w) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert noam_lr(4000, d, w) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)  # the peak, about 7.0e-4
    assert noam_lr(4000, d, w) == pytest.approx(6.987712e-4, rel=1e-6)
    assert noam_lr(16000, d, w) == pytest.approx(512 ** -0.5 * 16000 ** -0.5)
    assert noam_lr(2000, d, w, factor=2.0) == pytest.approx(2 * 512 ** -0.5 * 2000 * 4000 ** -1.5)
    assert max(range(1, 10000), key=lambda s: noam_lr(s, d, w)) == w


def test_schedule_steps_once_per_optimizer_step_and_round_trips():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p])
    sched = NoamSchedule(opt, 64, 10, 1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(noam_lr(1, 64, 10))
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(noam_lr(6, 64, 10))
    other = NoamSchedule(torch.optim.Adam([p]), 64, 10, 1.0)
    other.load_state_dict(sched.state_dict())
    assert other.lr() == sched.lr()


def test_label_smoothing_against_hand_computed_example():
    # V = 4 classes, eps = 0.3: target gets 0.7, each of the other 3 classes 0.1.
    logits = torch.tensor([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4]]])  # (1, 2, 4)
    target = torch.tensor([[1, 0]])  # second position is padding (pad id 0)
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.3, pad_id=0)
    z = [2.0, 0.5, -1.0, 0.0]
    logsumexp = math.log(sum(math.exp(v) for v in z))
    logp = [v - logsumexp for v in z]
    expected = -(0.7 * logp[1] + 0.1 * (logp[0] + logp[2] + logp[3]))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(-logp[1], rel=1e-6)


def test_no_smoothing_is_plain_cross_entropy_over_non_pad():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.0, pad_id=0)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=0, reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert nll.item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_loss_and_gradient_equal_log_softmax_autograd(monkeypatch, dtype, eps, chunk):
    # Several chunks, a last one that is short, pads inside and at the end of a chunk; the backward pass
    # gets gradients on both outputs (the trainer only differentiates the smoothed loss).
    monkeypatch.setattr(loss_module, "rows_per_chunk", lambda logits: chunk)
    torch.manual_seed(0)
    base = torch.randn(3, 5, 37) * 4
    target = torch.randint(1, 37, (3, 5))
    target[0, 2:] = 0
    target[2, 4] = 0
    grads = []
    for fn in (label_smoothed_cross_entropy, reference_label_smoothed_cross_entropy):
        logits = base.clone().to(dtype).requires_grad_()
        loss, nll = fn(logits, target, eps, 0)
        (loss + 0.3 * nll).backward()
        assert torch.equal(logits.detach(), base.to(dtype))  # the backward pass left the saved logits alone
        grads.append((loss.detach(), nll.detach(), logits.grad))
    (loss, nll, grad), (ref_loss, ref_nll, ref_grad) = grads
    assert grad.dtype == dtype and grad.shape == base.shape
    assert torch.allclose(loss, ref_loss, rtol=1e-5) and torch.allclose(nll, ref_nll, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 4e-3  # bf16: the gradient is rounded to bf16 in both
    assert torch.allclose(grad.float(), ref_grad.float(), atol=tol, rtol=0)
    assert grad[0, 2:].abs().sum() == 0 and grad[2, 4].abs().sum() == 0  # pads get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [3, 1000])
def test_fused_loss_writes_its_gradient_into_the_logits_when_asked(monkeypatch, dtype, chunk):
    """inplace=True (the trainer's call): the backward pass stores the gradient in the logits' own storage,
    a non-leaf tensor nothing reads after the loss, and the gradient reaching the layer below is the same.
    bf16: the gradient is computed in fp32 and rounded to bf16 once, so it lies within half a unit in the last
    place of bf16's 8-bit significand (2^-8 relative) of the exact value, the fp64 reference's on the same
    logits (plus fp32's rounding, far smaller)."""
    monkeypatch.setattr(loss_module, "rows_per_chunk", lambda logits: chunk)
    torch.manual_seed(1)
    hidden = torch.randn(4, 6, 16, dtype=torch.float64)
    w = torch.randn(41, 16, dtype=torch.float64) / 2
    target = torch.randint(1, 41, (4, 6))
    target[1, 3:] = 0
    out = {}
    for inplace in (False, True):
        h = hidden.to(dtype).requires_grad_()
        logits = h @ w.to(dtype).T  # (4, 6, 41), made by an operation: not a leaf
        loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, 0, inplace=inplace)
        kept = out["logits"] = logits.detach().clone()
        logits.register_hook(lambda g, store=out, key=inplace: store.update({key: g.clone()}))
        (loss + 0.5 * nll).backward()
        assert torch.equal(logits.detach(), kept) != inplace  # overwritten exactly when asked
        out[(inplace, "h")] = h.grad
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)  # the same numbers, other storage
    torch.testing.assert_close(out[(True, "h")], out[(False, "h")], rtol=0, atol=0)
    ref_logits = out["logits"].double().requires_grad_()  # the same logits, exactly, in fp64
    ref_loss, ref_nll = reference_label_smoothed_cross_entropy(ref_logits, target, 0.1, 0)
    (g_exact,) = torch.autograd.grad(ref_loss + 0.5 * ref_nll, ref_logits)
    rel = 1e-6 if dtype == torch.float32 else 2.0 ** -8 * 1.001
    assert ((out[True].double() - g_exact).abs() <= rel * g_exact.abs() + 1e-7).all()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5) and nll.item() == pytest.approx(ref_nll.item(),
                                                                                                     rel=1e-5)


def test_loss_implementations_agree_and_a_bad_name_fails():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 13)
    target = torch.randint(0, 13, (2, 5))
    fused = label_smoothed_cross_entropy(logits, target, 0.1, 0)
    ref = label_smoothed_cross_entropy(logits, target, 0.1, 0, impl="reference")
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="trainer.loss='chunky': must be one of auto, fused, compiled, reference"):
        label_smoothed_cross_entropy(logits, target, 0.1, 0, impl="chunky")


def test_auto_loss_is_compiled_on_gpus_that_can_compile_and_fused_elsewhere(monkeypatch):
    """trainer.loss=auto (the default): the compiled loss where a GPU measured it faster, the hand-written one on
    CPUs, under CUDA graphs without trainer.compile and where torch.compile cannot build GPU kernels. Named
    choices are kept."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(loss_module, "can_compile_for_gpu", lambda: True)
    assert loss_module.choose("auto", cpu) == "fused"
    assert loss_module.choose("auto", gpu) == "compiled"
    assert loss_module.choose("auto", gpu, cuda_graphs=True) == "fused"
    assert loss_module.choose("auto", gpu, cuda_graphs=True, compile=True) == "compiled"  # as `all` measured it
    assert loss_module.choose("fused", gpu) == "fused" and loss_module.choose("compiled", cpu) == "compiled"
    monkeypatch.setattr(loss_module, "can_compile_for_gpu", lambda: False)
    assert loss_module.choose("auto", gpu) == "fused"


def test_no_c_compiler_means_no_compiled_gpu_loss(monkeypatch):
    """Triton builds a C launcher for its kernels: a slim image without cc, gcc or clang cannot compile."""
    can = loss_module.can_compile_for_gpu.__wrapped__
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(loss_module.shutil, "which", lambda name: None)
    assert can() is False
    monkeypatch.setenv("CC", "/opt/cc")
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)
    assert can() is True


def test_auto_loss_runs_as_fused_on_a_cpu():
    torch.manual_seed(0)
    logits, target = torch.randn(2, 5, 13), torch.randint(0, 13, (2, 5))
    auto = label_smoothed_cross_entropy(logits, target, 0.1, 0, impl="auto")
    torch.testing.assert_close(auto, label_smoothed_cross_entropy(logits, target, 0.1, 0, impl="fused"), rtol=0,
                               atol=0)


def _loss_and_grad(impl, logits, target):
    x = logits.detach().requires_grad_()
    h = x * 1  # a non-leaf, as the model's logits are (the fused loss then writes its gradient in place)
    loss, nll = label_smoothed_cross_entropy(h, target, 0.1, 0, impl=impl, inplace=True)
    loss.backward()
    return loss.detach(), nll.detach(), x.grad


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_equals_the_reference_and_compiles_once_for_every_row_count(dtype):
    """trainer.loss=compiled: the log_softmax form through torch.compile (rows dynamic) gives the reference's
    loss, NLL and gradient, pads included, and batches of other row counts reuse its graph."""
    from transformer.training.speed import speedups

    torch.manual_seed(0)
    graphs = None
    for rows in (37, 64, 101):
        logits = (3 * torch.randn(rows, 211)).to(dtype)
        target = torch.randint(1, 211, (rows,))
        target[::5] = 0  # pad positions
        ref = _loss_and_grad("reference", logits, target)
        got = _loss_and_grad("compiled", logits, target)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=0)
        torch.testing.assert_close(got[2], ref[2], **tol)
        assert got[2][::5].abs().max() == 0  # no gradient at pads
        if graphs is None:
            graphs = speedups.compiled_graphs()
    assert speedups.compiled_graphs() == graphs  # 64 and 101 rows ran the graph compiled for 37


@pytest.mark.slow
def test_compiled_loss_keeps_no_vocabulary_sized_buffer_and_passes_gradcheck():
    """The compiled loss's graphs (forward and backward) allocate nothing of the logits' (N, V) size: the
    forward keeps numbers per row, the backward writes its gradient into the logits. Autograd of the compiled
    log_softmax form stored the fp32 log-probabilities and a zeroed fp32 (N, V) tensor on GPUs
    (docs/benchmarks/cpu-checks-of-gpu-paths.md)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from transformer.training.tools.profiling import kernel_family

    torch.manual_seed(0)
    logits, target = (3 * torch.randn(45, 301)).to(torch.bfloat16), torch.randint(0, 301, (45,))
    torch._dynamo.reset()  # compiled afresh, its code not read from a cache
    loss_module._compiled.cache_clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: _loss_and_grad("compiled", logits, target))
    assert len(codes) == 2  # the forward graph and the backward graph
    shapes = [re.split(r",\s*", m.group(1).strip(", ")) for code in codes
              for m in re.finditer(r"empty_strided_\w+\(\(([^)]*)\)", code)]
    assert shapes and not [s for s in shapes if len([d for d in s if d != "1"]) > 1], shapes
    kernels = {m.group(1) for code in codes for m in re.finditer(r"\bcpp_(fused_\w+)\(", code)}
    # named as a GPU profile would name them, they fall in its "loss" family
    assert kernels and {kernel_family(f"triton_red_{k}") for k in kernels} == {"loss"}, kernels
    x = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)  # a leaf: the gradient in a new tensor
    target = torch.tensor([0, 3, 8, 0, 1, 2])
    assert torch.autograd.gradcheck(lambda x: label_smoothed_cross_entropy(x, target, 0.2, 0, impl="compiled"), (x,))


def test_chunked_loss_passes_gradcheck(monkeypatch):
    monkeypatch.setattr(loss_module, "rows_per_chunk", lambda logits: 2)
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 2, 0], [6, 0, 0]])
    assert torch.autograd.gradcheck(lambda x: label_smoothed_cross_entropy(x, target, 0.2, 0), (logits,))


def test_loss_chunks_fit_a_cpu_cache():
    assert loss_module.rows_per_chunk(torch.empty(0, 10000)) == 104
    assert loss_module.rows_per_chunk(torch.empty(0, 2_000_000)) == 1


def _schedule(anneal=0.0):
    return NoamSchedule(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), 64, 4, 1.0, anneal)


def _rates(sched, steps):
    rates = []
    for _ in range(steps):
        rates.append(sched.lr())
        sched.step()
    return rates


def test_anneal_over_max_steps_falls_linearly_to_zero_at_the_last_step():
    """optim.anneal=0.5 of max_steps=10: updates 1-6 use the Noam rate, 7-10 a fifth less each time, and
    the rate after the 10th update (which no update uses) is 0: the run is over."""
    sched = _schedule(anneal=0.5)
    sched.plan_anneal(max_steps=10)
    rates = _rates(sched, 9)
    assert rates[:6] == pytest.approx([noam_lr(s, 64, 4) for s in range(1, 7)])
    falls = zip(range(7, 10), (0.8, 0.6, 0.4), strict=True)
    assert rates[6:] == pytest.approx([noam_lr(s, 64, 4) * f for s, f in falls])
    assert not sched.annealed and sched.anneal_end == 10
    sched.step()
    assert sched.annealed and sched.lr() == 0.0


def test_anneal_by_time_falls_over_the_steps_given_and_resumes_exactly():
    """anneal_now(10) at step 30. A schedule resumed mid-fall from state_dict() gives the same rates;
    optim.anneal=0 drops the fall."""
    sched = _schedule(anneal=0.25)
    _rates(sched, 30)
    assert not sched.falling
    sched.anneal_now(10)
    assert (sched.anneal_start, sched.anneal_end) == (30, 40) and sched.falling
    sched.anneal_now(99)  # the flag stays raised on later steps: the fall is not restarted
    assert sched.anneal_end == 40
    _rates(sched, 4)
    resumed, dropped = _schedule(anneal=0.25), _schedule(anneal=0.0)
    resumed.load_state_dict(sched.state_dict())
    dropped.load_state_dict(sched.state_dict())
    assert _rates(resumed, 6) == _rates(sched, 6)
    assert sched.annealed and resumed.annealed and not dropped.annealed
    assert dropped.lr() == noam_lr(35, 64, 4)


def test_anneal_by_time_comes_first_when_a_max_steps_fall_is_still_ahead():
    sched = _schedule(anneal=0.5)
    sched.plan_anneal(max_steps=100)
    _rates(sched, 20)
    assert not sched.falling  # planned for step 50, not begun
    sched.anneal_now(20)
    assert (sched.anneal_start, sched.anneal_end) == (20, 40)


def test_fall_steps_count_the_time_left_in_epochs_not_in_the_pace_of_steps_so_far():
    """anneal=0.25 at batch 50 of epoch 3, 100 batches an epoch: 3.5 epochs so far, so the rest of the time
    covers 3.5 / 3 epochs, 117 batches. A batch ramp whose early epochs had 400 small batches each changes
    nothing, where the pace in steps so far would have planned about a third of its steps again."""
    assert fall_steps(0.25, 3, 50, 1, lambda e: 100) == 117
    assert fall_steps(0.25, 3, 50, 1, lambda e: 400 if e < 3 else 100) == 117
    assert fall_steps(0.25, 3, 50, 2, lambda e: 100) == 58  # accumulate=2: two batches a step
    # Epochs ahead with another budget count their own batches: 0.5 of epoch 3, then 2/3 of 60 in epoch 4.
    assert fall_steps(0.25, 3, 50, 1, lambda e: 100 if e <= 3 else 60) == 90
    assert fall_steps(0.5, 0, 5, 1, lambda e: 8) == 5  # (the distributed test's case: epochs of 8 batches)


@pytest.mark.gpu
def test_cuda_compiled_and_fused_losses_agree_at_a_training_size():
    """On a GPU, bf16 logits of a 16k-token batch's quarter over a 32k vocabulary: the compiled loss (Triton
    kernels from the compiler) and the fused one give the same loss and gradient."""
    torch.manual_seed(0)
    logits = (4 * torch.randn(4096, 32000, device="cuda")).bfloat16()
    target = torch.randint(1, 32000, (4096,), device="cuda")
    target[::9] = 0
    fused = _loss_and_grad("fused", logits, target)
    compiled = _loss_and_grad("compiled", logits, target)
    torch.testing.assert_close(compiled[0], fused[0], rtol=1e-4, atol=0)
    torch.testing.assert_close(compiled[1], fused[1], rtol=1e-4, atol=0)
    torch.testing.assert_close(compiled[2].float(), fused[2].float(), rtol=2e-2, atol=1e-6)
    # trainer.loss=auto takes it on this GPU: Triton and a C compiler are there
    assert loss_module.choose("auto", logits.device) == "compiled"


def test_parallelize_says_when_auto_takes_the_compiled_loss(monkeypatch, caplog):
    """The run's log names the loss `auto` chose where it compiles (its first step takes seconds more)."""
    import logging

    from tests.helpers.cli import compose_cfg
    from transformer.config import ModelConfig
    from transformer.dist import DistEnv
    from transformer.model import Transformer
    from transformer.training.distributed import parallelize as parallelize_module

    cfg = compose_cfg("experiment=copy")
    model = Transformer.from_config(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), 20, 20, True)
    cpu = DistEnv(device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="transformer"):
        assert parallelize_module.parallelize(model, cfg, cpu).loss == "fused"
        assert "trainer.loss=auto" not in caplog.text
        monkeypatch.setattr(parallelize_module, "choose_loss", lambda loss, device, graphs, compile: "compiled")
        assert parallelize_module.parallelize(model, cfg, cpu).loss == "compiled"
    assert "trainer.loss=auto: the compiled label-smoothed loss" in caplog.text


def test_normalising_and_clipping_ride_fused_adams_read_of_the_gradients(tmp_path):
    """The step's gradients are normalised by its tokens and clipped by one scale that fused Adam applies as it
    reads them (`grad_scale`): the same update and gradient norm as normalising in place, then
    clip_grad_norm_ (the path fp16's grad scaler still takes), to float rounding, with one pass over the
    gradients (their norms, shared by the non-finite flag) where that path made four."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.helpers.composed import small_trainer
    from transformer.training.loop.hotpath import LaggedFlag, TrainWindow

    class Passes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("_foreach_norm", "_foreach_mul_", "_fused_adam_"):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    fold, plain = (small_trainer(tmp_path / name, "trainer.clip_norm=0.5", "model.dropout=0.0")
                   for name in ("fold", "plain"))
    plain.guard.can_skip = False  # the in-place path, which the step picks when it is built
    plain.stepper._step_optimizer = plain.stepper._scaled_update
    batches = list(fold.data.train_loader(0))[:4]
    norms = {}
    for name, t in (("fold", fold), ("plain", plain)):
        window, flag, passes = TrainWindow(), LaggedFlag(), Passes()
        for i, b in enumerate(batches):
            # the passes of the last step, Adam's state made (the mode sends every operator through Python)
            with passes if i == len(batches) - 1 else contextlib.nullcontext():
                result, _ = t._train_step([b], window, flag)
            norms.setdefault(name, []).append(float(result.grad_norm))
        assert passes.seen == (["_foreach_norm", "_fused_adam_"] if name == "fold" else
                               ["_foreach_norm", "_foreach_mul_", "_foreach_norm", "_foreach_mul_", "_fused_adam_"])
    assert max(norms["fold"]) > 0.5  # clipping acted
    assert norms["fold"] == pytest.approx(norms["plain"], rel=1e-5)
    for a, b in zip(fold.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
