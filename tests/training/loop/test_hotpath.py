"""The training step without host reads (transformer/training/loop/hotpath.py), on CPU.

The GPU tier counts real synchronisations with torch.cuda.set_sync_debug_mode; here a dispatch mode spots
the operations that would synchronise on a GPU: scalar reads (item, float(), bool()), nonzero and boolean
indexing, and Python-level tolist().
"""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.cli import compose_cfg, free_port
from tests.helpers.composed import small_trainer as make_trainer  # composed once a process
from tests.helpers.dist import join_gloo
from tests.training.loop.test_trainer import SMALL, ragged_pairs
from transformer import dist
from transformer.data.batch import PAD, collate
from transformer.data.copy import CopyData
from transformer.exit_codes import PREEMPTED as PREEMPTED_EXIT_CODE
from transformer.tasks import build_task
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.distributed.parallelize import build_model, parallelize
from transformer.training.loop.hotpath import LaggedFlag, StepTimer, TrainWindow
from transformer.training.loop.trainer import Trainer

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.is_nonzero.default, aten.equal.default}


class HostReadSpy(TorchDispatchMode):
    """Records operations that read device values on the host. Scalar reads of tensors whose storage is in
    `exempt` (Adam's step counters, which live on the CPU in torch's optimisers even for GPU training) and
    anything while `paused` are not recorded."""

    def __init__(self, exempt=()):
        super().__init__()
        self.exempt, self.paused, self.seen = set(exempt), False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            if func in HOST_READS and not (func is aten._local_scalar_dense.default
                                           and args[0].untyped_storage().data_ptr() in self.exempt):
                self.seen.append(str(func))
            if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.seen.append("boolean indexing")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def spy(monkeypatch):
    """A HostReadSpy factory; also records Tensor.tolist, and lets LaggedFlag read (its one allowed read)."""
    made = []
    tolist = torch.Tensor.tolist

    def spied_tolist(self):
        for s in made:
            if not s.paused:
                s.seen.append("tolist")
        return tolist(self)

    read = LaggedFlag._read

    def lagged_read(self):
        for s in made:
            s.paused = True
        try:
            return read(self)
        finally:
            for s in made:
                s.paused = False

    monkeypatch.setattr(torch.Tensor, "tolist", spied_tolist)
    monkeypatch.setattr(LaggedFlag, "_read", lagged_read)

    def make(exempt=()):
        made.append(HostReadSpy(exempt))
        return made[-1]
    return make


def test_steps_between_logged_lines_read_nothing_on_the_host(tmp_path, spy):
    t = make_trainer(tmp_path, "trainer.clip_norm=1.0", "trainer.accumulate=2")
    batches = list(t.data.train_loader(0))[:8]  # collated beforehand: host-side work, not the step's
    window, flag = TrainWindow(), LaggedFlag()
    t._train_step(batches[:2], window, flag)  # creates Adam's state
    steps = [s["step"].untyped_storage().data_ptr() for s in t.optimizer.state.values()]
    with spy(exempt=steps) as s:
        for i in range(2, 8, 2):
            result, stop = t._train_step(batches[i:i + 2], window, flag)
    assert s.seen == [] and stop is False
    assert all(isinstance(v, torch.Tensor) for v in (result.tokens, result.loss, result.nll, result.grad_norm))
    with spy() as s:
        shown = t._log_train(window, result.grad_norm)
    assert s.seen == ["tolist"]  # the logged line: one read for tokens, loss, nll and grad norm together
    assert shown["loss"] > 0 and shown["tok/s"] > 0


def test_the_step_sets_training_mode_only_when_a_module_left_it(tmp_path, monkeypatch):
    """The step no longer walks the module tree with train() every step (host time a host-bound GPU step waits
    for), but a module left in eval (validation, or any one submodule) is back in training mode, its dropout
    on, before the next forward."""
    t = make_trainer(tmp_path, "model.dropout=0.1")
    batches = iter(t.data.train_loader(0))
    window, flag = TrainWindow(), LaggedFlag()
    calls = []
    train = type(t.net).train
    monkeypatch.setattr(type(t.net), "train", lambda self, mode=True: calls.append(mode) or train(self, mode))
    t._train_step([next(batches)], window, flag)
    t._train_step([next(batches)], window, flag)
    assert calls == []  # built in training mode: nothing to set
    t.model.decoder[0].self_attn.eval()  # one submodule, as a careless caller might leave it
    seen = []
    hook = t.model.decoder[0].self_attn.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    t._train_step([next(batches)], window, flag)
    assert calls == [True] and seen == [True] and all(m.training for m in t.net.modules())
    t.model.eval()  # as validation leaves it (eval() is train(False): recorded too)
    t._train_step([next(batches)], window, flag)
    hook.remove()
    assert calls == [True, False, True] and seen == [True, True] and all(m.training for m in t.net.modules())


def test_step_timer_reads_the_host_clock_at_every_mark(monkeypatch):
    """transformer-bench's host time a phase: the mean over steps of the host clock between marks (on a GPU
    beside the device events; on a CPU the phases themselves)."""
    from transformer.training.loop import hotpath
    clock = iter([0.0, 0.004, 0.005, 0.007,  1.0, 1.006, 1.009, 1.010])  # two steps: start, three marks
    monkeypatch.setattr(hotpath.time, "perf_counter", lambda: next(clock))
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start()
        for phase in ("forward_backward", "communication", "optimizer"):
            timer.mark(phase)
    host = timer.host_summary()
    assert host == pytest.approx({"forward_backward": 5.0, "communication": 2.0, "optimizer": 1.5})
    assert timer.summary() == host  # a CPU runs its kernels synchronously: the host clock is the step's


def test_the_spy_sees_what_the_old_step_did(spy):
    """The checks above can fail: .item(), float() and boolean indexing (the old loss) are all caught."""
    x = torch.arange(6.0)
    with spy() as s:
        x.sum().item()
        float(x.max())
        x[x > 2].sum()
    assert s.seen == ["aten._local_scalar_dense.default", "aten._local_scalar_dense.default", "boolean indexing"]


def test_window_logs_token_weighted_means(tmp_path):
    t = make_trainer(tmp_path, "model.dropout=0.0")
    batches = list(t.data.train_loader(0))[:3]
    window, flag = TrainWindow(), LaggedFlag()
    results = [t._train_step([b], window, flag)[0] for b in batches]
    w = window.read()
    assert w["tokens"] == sum(b.n_tokens for b in batches) and w["steps"] == 3
    assert w["loss"] == pytest.approx(sum(r.loss.item() for r in results), rel=1e-9)
    window.reset()
    assert window.read()["tokens"] == 0


def test_loss_without_boolean_indexing_equals_the_selected_rows():
    torch.manual_seed(0)
    logits, target = torch.randn(3, 5, 11), torch.randint(4, 11, (3, 5))
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    for eps in (0.0, 0.1):
        loss, nll = label_smoothed_cross_entropy(logits, target, eps, PAD)
        keep = target.reshape(-1) != PAD
        lprobs = F.log_softmax(logits, -1).view(-1, 11)[keep]  # the former implementation's rows
        ref_nll = F.nll_loss(lprobs, target.reshape(-1)[keep], reduction="sum")
        ref = (1 - eps) * ref_nll - eps / 10 * (lprobs.sum() - lprobs.gather(1, target.reshape(-1)[keep, None]).sum())
        assert torch.allclose(nll, ref_nll, rtol=1e-6) and torch.allclose(loss, ref, rtol=1e-6)


def test_lagged_flag_returns_the_push_lag_pushes_before():
    values = (0.0, 1.0, 0.0, 2.0, 0.0)
    flag = LaggedFlag(lag=1)
    assert [flag.push(torch.tensor(v)) for v in values] == [False, False, True, False, True]
    flag = LaggedFlag()  # the trainer's: two pushes late
    assert [flag.push(torch.tensor(v)) for v in values] == [False, False, False, True, False]
    flag = LaggedFlag()
    assert [flag.push(torch.tensor(v)) for v in ([0.0, 1.0], [1.0, 0.0], [0.0, 0.0])] == [
        (False, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="lag=0"):
        LaggedFlag(lag=0)


class FakeGpu:
    """A device `behind` steps behind the host: when the host has queued step n, the device has finished the
    work of step n - behind. `start_copy` stands for LaggedFlag's copy and event record, whose query() and
    synchronize() behave as CUDA's (synchronize counted: a host sync)."""

    def __init__(self, behind: int):
        self.behind, self.queued, self.syncs = behind, 0, 0

    def start_copy(self, flag):
        gpu, queued_at = self, self.queued

        class Event:
            def query(self):
                return gpu.queued - queued_at >= gpu.behind

            def synchronize(self):
                gpu.syncs += 1
        return flag.clone(), Event()


@pytest.mark.parametrize("lag, behind, waits", [(2, 1, 0), (2, 2, 0), (2, 3, 8), (1, 1, 0), (1, 2, 9)])
def test_lagged_flag_waits_only_when_the_host_is_more_than_lag_steps_ahead(monkeypatch, lag, behind, waits):
    """The per-step event wait is gone while the device is at most `lag` steps behind the host; when it is
    further behind, the host waits (and the wait is counted), and the values read are the same either way."""
    gpu = FakeGpu(behind)
    flag = LaggedFlag(lag)
    monkeypatch.setattr(flag, "_start_copy", gpu.start_copy)
    got = []
    for i in range(10):
        gpu.queued = i  # the host queued step i, whose statistics hold the flag
        got.append(flag.push(torch.tensor(float(i == 4))))
    assert got == [i == 4 + lag for i in range(10)]
    assert flag.reads == 10 - lag and flag.waits == gpu.syncs == waits


def test_stop_signal_stops_all_ranks_two_steps_late_with_a_checkpoint(tmp_path, monkeypatch):
    """A signal before step 3's all-reduce rides in step 3's statistics; they are read after step 5 (the flag
    is read two steps late), which is where the run checkpoints and exits with code 3."""
    t = make_trainer(tmp_path, "trainer.max_steps=20", "trainer.val_every=1000", "checkpoint.every_steps=1000",
                     "trainer.max_epochs=null")
    step = t._optimizer_step
    t.stop = SimpleNamespace(signum=None)  # what launcher.StopRequest sets on SIGTERM

    def signalled_at_step_3(micro):
        if t.step == 2:
            t.stop.signum = 15
        return step(micro)

    monkeypatch.setattr(t, "_optimizer_step", signalled_at_step_3)
    assert t.train() == PREEMPTED_EXIT_CODE
    assert t.step == 5
    assert [s for s, _ in t.checkpointer.step_files()] == [5]


def _late_worker(rank: int, port: int, run_dir: str, anneal: float):
    torch.set_num_threads(1)
    env = join_gloo(rank, 2, port)  # only rank 0 writes the checkpoints
    try:
        cfg = compose_cfg(*SMALL, "trainer.max_minutes=1", "trainer.max_epochs=null", "trainer.max_steps=null",
                          "trainer.val_every=1000", "checkpoint.every_steps=1000", f"optim.anneal={anneal}")
        data = CopyData(cfg, cfg.seed, rank, 2)
        torch.manual_seed(0)
        model = build_model(cfg, data)
        t = Trainer(cfg, env, parallelize(model, cfg, env), data, build_task(cfg), Path(run_dir))
        # Only rank 1's clock passes the limit, or the start of the fall (after 3 steps); rank 0's never does.
        seconds = 60.0 * (1 - anneal)
        t.clock.seconds = (lambda: seconds * (t.step >= 3)) if rank == 1 else (lambda: 0.0)
        code = t.train()
        Path(run_dir, f"rank{rank}.json").write_text(json.dumps(
            {"code": code, "step": t.step, "fall": [t.scheduler.anneal_start, t.scheduler.anneal_end]}))
        t.close()
    finally:
        dist.close()


@pytest.mark.distributed
@pytest.mark.parametrize("anneal, step, fall", [(0.0, 6, [None, None]), (0.5, 12, [6, 12])])
def test_time_flags_on_one_rank_act_on_every_rank_at_the_same_step(tmp_path, anneal, step, fall):
    """The late and anneal flags are all-reduced like the stop flag. A rank whose clock is not late stops with
    the one that is (otherwise it would wait in the next collective until trainer.timeout_s); a rank whose
    clock has not reached optim.anneal's start begins the fall at the same step, over the same steps, so the
    replicas keep one learning rate and end together."""
    mp.start_processes(_late_worker, args=(free_port(), str(tmp_path), anneal), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"code": 0, "step": step, "fall": fall}] * 2


def test_padding_to_a_multiple_changes_neither_loss_nor_gradients(tmp_path):
    ds = ragged_pairs(6, seed=1)
    batch = collate([ds[i] for i in range(6)])
    assert batch.src.size(1) % 16 and batch.tgt_in.size(1) % 16  # padding will add positions
    grads = []
    for multiple in (1, 16):
        t = make_trainer(tmp_path / str(multiple), "model.dropout=0.0", f"trainer.pad_to_multiple={multiple}")
        out = t._optimizer_step([batch])
        grads.append((out.loss, [p.detach().clone() for p in t.model.parameters()]))
    (loss1, w1), (loss8, w8) = grads
    assert torch.allclose(loss1, loss8, rtol=1e-5)
    for a, b in zip(w1, w8, strict=False):
        assert torch.allclose(a, b, atol=1e-6)


def test_activation_checkpointing_gives_the_same_gradients(tmp_path):
    ds = ragged_pairs(8, seed=2)
    batch = collate([ds[i] for i in range(8)])
    runs = []
    for on in (False, True):
        t = make_trainer(tmp_path / str(on), "model.dropout=0.1", f"trainer.activation_checkpointing={on}")
        torch.manual_seed(5)  # the same dropout masks; checkpointing replays them in the recomputation
        logits = t.net(batch.src, batch.tgt_in)
        loss, _ = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.1, PAD)
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in t.model.parameters()], t.model.state_dict().keys()))
    (l0, g0, k0), (l1, g1, k1) = runs
    assert torch.equal(l0, l1) and k0 == k1  # parameter names (and so checkpoints) unchanged
    for a, b in zip(g0, g1, strict=False):
        assert torch.allclose(a, b, atol=1e-7)
    assert np.isfinite(l0.item())
