import copy
import json
import re

import numpy as np
import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.models import one_thread  # noqa: F401  (autouse)
from transformer.data.batch import PairDataset, Ragged, collate
from transformer.data.copy import CopyData
from transformer.dist import DistEnv
from transformer.tasks import build_task
from transformer.training.components.checkpoint import (
    Checkpointer,
    CheckpointError,
    atomic_save,
    changed_settings,
    load_checkpoint,
    load_model,
)
from transformer.training.distributed.parallelize import build_model, parallelize
from transformer.training.loop.trainer import Trainer

SMALL = ["experiment=copy", "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2",
         "data.copy.train_size=256", "data.copy.val_size=32", "data.copy.test_size=32", "data.max_tokens=200",
         "trainer.progress=false", "logger.trackers=[]"]  # no TensorBoard: its end-of-run figures took most of a run


def make_trainer(tmp_path, *overrides, seed_model=0):
    cfg = compose_cfg(*SMALL, *overrides)
    data = CopyData(cfg, cfg.seed, 0, 1)
    torch.manual_seed(seed_model)
    model = build_model(cfg, data)
    return Trainer(cfg, DistEnv(), parallelize(model, cfg, DistEnv()), data, build_task(cfg), tmp_path)


def ragged_pairs(n, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(4, 11, size=rng.integers(2, 9)).tolist() for _ in range(n)]
    return PairDataset(Ragged.from_lists(seqs), Ragged.from_lists([s[::-1] for s in seqs]))


def test_accumulation_equals_one_big_batch(tmp_path):
    """K micro-batches of unequal token counts with accumulate=K give the update of one batch holding
    all their sentences. Tolerance: 1e-6 absolute on the weights after 3 Adam steps (fp32; only the
    summation order differs)."""
    ds = ragged_pairs(12, seed=3)
    items = [ds[i] for i in range(12)]
    big = make_trainer(tmp_path / "a", "model.dropout=0.0", "trainer.label_smoothing=0.1")
    acc = make_trainer(tmp_path / "b", "model.dropout=0.0", "trainer.label_smoothing=0.1", "trainer.accumulate=3")
    for _ in range(3):
        big._optimizer_step([collate(items)])
        acc._optimizer_step([collate(items[:2]), collate(items[2:7]), collate(items[7:])])
    for (name, a), b in zip(big.model.named_parameters(), acc.model.parameters(), strict=False):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
    # And the test can fail: a different split normalised per micro-batch would not match.
    assert any(not torch.equal(a, b) for a, b in zip(big.model.parameters(), make_trainer(
        tmp_path / "c", seed_model=1).model.parameters(), strict=False))


def test_checkpoint_round_trip_gives_identical_next_step(tmp_path):
    t1 = make_trainer(tmp_path / "one", "model.dropout=0.1")
    batches = list(t1.data.train_loader(0))
    for b in batches[:3]:
        t1._optimizer_step([b])
        t1.step += 1
    path = tmp_path / "ck.pt"
    atomic_save(t1.state_dict(), path)
    t2 = make_trainer(tmp_path / "two", "model.dropout=0.1", seed_model=99)
    ckpt = load_checkpoint(path)
    t2.load_state_dict(ckpt, str(path))  # also sets this process's RNG to the saved state
    assert t2.step == 3
    out1 = t1._optimizer_step([batches[3]])
    torch.set_rng_state(ckpt["rng"][0]["cpu"])  # both trainers share this process's RNG: rewind for t2
    out2 = t2._optimizer_step([batches[3]])
    assert out1[1] == out2[1]  # the same loss, bit for bit (dropout RNG restored)
    for a, b in zip(t1.model.parameters(), t2.model.parameters(), strict=False):
        assert torch.equal(a, b)


def test_checkpoint_is_self_sufficient_and_weights_only(tmp_path):
    t = make_trainer(tmp_path)
    path = Checkpointer(tmp_path, keep_last=2).save(t.state_dict(), step=7, is_best=True)
    raw = torch.load(path, weights_only=True)
    assert raw["model_args"]["d_model"] == 32 and raw["trainer"]["step"] == 0
    model, tokenizer, _ = load_model(tmp_path / "checkpoints" / "best.pt")
    src = torch.randint(4, 11, (2, 5))
    assert torch.equal(model(src, src), t.model.eval()(src, src))
    assert tokenizer.decode_tgt([4, 5]) == "4 5"


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_checkpoint_with_pickled_object_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": "transformer-checkpoint/1", "payload": Evil()}, path)
    refused = "not a checkpoint written by transformer-train, or a file holding executable pickled objects: refused"
    with pytest.raises(CheckpointError, match=refused) as e:
        load_checkpoint(path)
    assert "weights_only" not in str(e.value)  # no advice to take the unsafe step


def test_keep_last_and_links(tmp_path):
    t = make_trainer(tmp_path)
    ck = Checkpointer(tmp_path, keep_last=2)
    state = t.state_dict()
    for step, best in [(1, True), (2, False), (3, False)]:
        ck.save(state, step, best)
    assert [s for s, _ in ck.step_files()] == [3, 2]
    assert (tmp_path / "checkpoints" / "best.pt").is_file()  # survives its step file's deletion
    assert (tmp_path / "checkpoints" / "last.pt").samefile(tmp_path / "checkpoints" / "step_00000003.pt")


def test_corrupt_newest_checkpoint_falls_back(tmp_path, caplog):
    t = make_trainer(tmp_path)
    ck = Checkpointer(tmp_path, keep_last=3)
    state = t.state_dict()
    ck.save(state, 1, False)
    newest = ck.save(state, 2, False)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash mid-copy
    path, loaded = ck.find_resume()
    assert path.name == "step_00000001.pt" and loaded["format"] == state["format"]
    assert "skipping corrupt checkpoint" in caplog.text


def test_model_mismatch_is_refused(tmp_path):
    t = make_trainer(tmp_path)
    state = copy.deepcopy(t.state_dict())
    other = make_trainer(tmp_path / "x", "model.d_ff=128")
    with pytest.raises(CheckpointError, match="holds another model"):
        other.load_state_dict(state, "ck.pt")


def test_resume_under_other_dropout_rates_names_the_overrides_that_restore_them(tmp_path):
    """A run begun when model=base's attention and feed-forward dropout were null (model.dropout) is refused under
    today's 0.0, with the overrides that resume it as it was trained; a change of weights gets no such hint."""
    t = make_trainer(tmp_path, "model.attention_dropout=null", "model.ffn_dropout=0.2")
    state = copy.deepcopy(t.state_dict())
    other = make_trainer(tmp_path / "x", "model.attention_dropout=0", "model.ffn_dropout=0")
    with pytest.raises(CheckpointError, match=r"holds another model .*; to resume it as it was trained, add "
                                              r"model.attention_dropout=null model.ffn_dropout=0.2$"):
        other.load_state_dict(state, "ck.pt")
    again = make_trainer(tmp_path / "y", "model.attention_dropout=null", "model.ffn_dropout=0.2")
    again.load_state_dict(state, "ck.pt")
    with pytest.raises(CheckpointError, match=r"holds another model \(checkpoint vs config: \{'d_ff'[^;]*$"):
        make_trainer(tmp_path / "z", "model.attention_dropout=null", "model.ffn_dropout=0.2",
                     "model.d_ff=128").load_state_dict(state, "ck.pt")


def test_progress_total_counts_optimizer_steps_of_max_epochs(tmp_path):
    """The bar's ETA needs a total: max_steps, or ceil(batches / accumulate) * max_epochs, whichever comes first."""
    t = make_trainer(tmp_path, "trainer.max_epochs=3", "trainer.max_steps=null", "trainer.accumulate=2")
    n = t.data.num_train_batches(0)
    assert n > 2 and t._total_steps() == -(-n // 2) * 3
    assert make_trainer(tmp_path, "trainer.max_epochs=3", "trainer.max_steps=5")._total_steps() == 5
    steps = make_trainer(tmp_path, "trainer.max_epochs=1", "trainer.max_steps=10000")._total_steps()
    assert steps == n


@pytest.mark.parametrize("capability, expected", [((7, 0), None), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_precision_uses_bf16_only_where_the_gpu_has_it_natively(monkeypatch, capability, expected):
    """A V100 (7.0) reports torch.cuda.is_bf16_supported() but only emulates bf16: auto means fp32 there."""
    from transformer.training.distributed.parallelize import autocast_dtype

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert autocast_dtype("auto", torch.device("cuda")) is expected
    assert autocast_dtype("bf16", torch.device("cuda")) is torch.bfloat16  # asked for explicitly: as asked


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_precision_on_a_cpu_is_bf16_only_with_bf16_units(monkeypatch, native, expected):
    """An AMX Xeon trains model=small 1.16x faster in bf16; an AVX2 EPYC 36x slower: auto follows the CPU."""
    from transformer.training.distributed.parallelize import autocast_dtype
    from transformer.training.speed import speedups

    monkeypatch.setattr(speedups, "native_bf16_cpu", lambda: native)
    assert autocast_dtype("auto", torch.device("cpu")) is expected
    assert autocast_dtype("fp32", torch.device("cpu")) is None


def test_bf16_on_cpu_autocasts_the_forward_pass_and_learns_as_fp32_does(tmp_path):
    """precision=bf16 on a CPU: the products run in bf16 (oneDNN's AMX/AVX512-BF16 kernels where the CPU has
    them), the weights stay fp32, and 60 steps on one batch follow fp32's loss curve to 2% (measured: 3.90 ->
    1.832 in both). fp16 stays fp32 on a CPU."""
    from transformer.training.distributed.parallelize import autocast_dtype

    assert autocast_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype("fp16", torch.device("cpu")) is None
    curves, seen = {}, []
    for precision in ("fp32", "bf16"):
        t = make_trainer(tmp_path / precision, f"trainer.precision={precision}", "model.dropout=0.0")
        hook = t.model.decoder[0].ff.w1.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        batch = next(iter(t.data.train_loader(0)))
        curves[precision] = [t._optimizer_step([batch]).loss.item() / batch.n_tokens for _ in range(60)]
        hook.remove()
        assert all(p.dtype is torch.float32 for p in t.model.parameters())
    assert seen[0] is torch.float32 and seen[-1] is torch.bfloat16
    assert curves["bf16"][-1] < 0.5 * curves["bf16"][0]
    assert curves["bf16"] != curves["fp32"]  # the products really ran in another precision
    assert curves["bf16"] == pytest.approx(curves["fp32"], rel=0.02)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_bf16_units_warns_that_fp32_is_faster(tmp_path, monkeypatch, caplog, native):
    from transformer.training.speed import speedups

    monkeypatch.setattr(speedups, "native_bf16_cpu", lambda: native)
    make_trainer(tmp_path, "trainer.precision=bf16")
    make_trainer(tmp_path, "trainer.precision=fp32")
    warned = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if native else 1)
    assert all("trainer.precision=fp32 trains faster" in r.getMessage() for r in warned)


@pytest.mark.parametrize("capability, slow", [((7, 0), True), ((8, 0), False), ((9, 0), False)])
def test_bf16_on_a_gpu_before_ampere_is_called_emulated(monkeypatch, capability, slow):
    from transformer.training.speed import speedups

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    why = speedups.emulated_bf16(torch.device("cuda", 0))
    assert (why is not None) == slow
    assert why is None or "trainer.precision=fp16" in why


def test_max_minutes_ends_the_run_normally_two_steps_late(tmp_path):
    """trainer.max_minutes: the step whose clock is past the limit raises the late flag; like the stop flag it
    is read two steps late (every rank reads the same all-reduced value), and the run then ends as max_steps
    ends it: validation, a checkpoint, exit code 0 and the end-of-run evaluation."""
    t = make_trainer(tmp_path, "trainer.max_minutes=1", "trainer.max_epochs=null", "trainer.max_steps=null",
                     "trainer.val_every=1000", "checkpoint.every_steps=1000")
    t.clock.seconds = lambda: 60.0 * (t.step >= 3)  # minute 1 is over once 3 steps have run
    assert t.train() == 0
    assert t.step == 6  # step 4 saw the limit, step 6 read its flag
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert ckpt["trainer"]["step"] == 6
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "valid"] == [6]
    assert [x["eta_s"] for x in lines if x["split"] == "train"] == [0.0]  # the ETA counts the minutes left
    # The same command again (a resume, to redo an interrupted end of run): no step more, the same end.
    again = make_trainer(tmp_path, "trainer.max_minutes=1", "trainer.max_epochs=null", "trainer.max_steps=null",
                         "trainer.val_every=1000", "checkpoint.every_steps=1000")
    again.load_state_dict(ckpt)
    assert again.train() == 0
    assert again.step == 6 and load_checkpoint(tmp_path / "checkpoints" / "last.pt")["trainer"]["step"] == 6


def test_anneal_by_time_starts_two_steps_late_and_ends_the_run_when_the_rate_reaches_zero(tmp_path):
    """optim.anneal=0.5 of trainer.max_minutes=1: step 4's clock passes minute 0.5; its flag, read after step 6,
    starts the fall there, over the 6 steps that the first half of the time took. The run ends normally at
    step 12, with the rate at 0, long before its time limit."""
    t = make_trainer(tmp_path, "trainer.max_minutes=1", "optim.anneal=0.5", "trainer.max_epochs=null",
                     "trainer.max_steps=null", "trainer.val_every=1000", "checkpoint.every_steps=1000")
    t.clock.seconds = lambda: 30.0 * (t.step >= 3)
    assert t.train() == 0
    assert t.step == 12
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert ckpt["scheduler"] == {"step_num": 12, "anneal_start": 6, "anneal_steps": 6}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["lr"], x["eta_s"]) for x in lines if x["split"] == "train"] == [(12, 0.0, 0.0)]
    assert [x["step"] for x in lines if x["split"] == "valid"] == [12]


@pytest.mark.parametrize("epoch_end", [True, False])
def test_val_epoch_end_false_leaves_epoch_ends_to_val_every(tmp_path, epoch_end):
    """With val_every shorter than an epoch, an epoch end's validation nearly repeats the one before it:
    trainer.val_epoch_end=false skips it (and its checkpoint). The run's end is still validated and saved."""
    t = make_trainer(tmp_path, "trainer.max_epochs=3", "trainer.max_steps=null", "trainer.val_every=4",
                     "checkpoint.every_steps=1000", f"trainer.val_epoch_end={epoch_end}")
    n = t.data.num_train_batches(0)
    assert t.train() == 0 and t.step == 3 * n and n % 4 != 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validated = [x["step"] for x in lines if x["split"] == "valid"]
    every = list(range(4, 3 * n, 4))
    assert validated == (sorted(every + [n, 2 * n, 3 * n]) if epoch_end else every + [3 * n])
    saved = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert saved[-1] == 3 * n and (n in saved) == epoch_end


def test_batches_grow_by_epoch_in_training(tmp_path):
    """data.max_tokens_by_epoch reaches the trainer: after the ramp's 100-token epoch, data.max_tokens=400
    makes fewer steps."""
    t = make_trainer(tmp_path, "trainer.max_epochs=2", "trainer.max_steps=null", "trainer.val_every=1000",
                     "checkpoint.every_steps=1000", "data.max_tokens_by_epoch=[100]", "data.max_tokens=400")
    small, big = t.data.num_train_batches(0), t.data.num_train_batches(1)
    assert big < small / 2
    assert t._total_steps() == small + big  # the ETA counts each epoch with its own batches
    assert t.train() == 0 and t.step == small + big


def test_cuda_attention_skips_cudnn_and_cpu_leaves_the_switch_alone():
    """cuDNN's SDPA plans every new batch shape on the host (transformer/model/layers.py)."""
    from transformer.model.layers import no_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        no_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        no_cudnn_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_dropout_by_epoch_sets_each_epochs_rate_and_resumes_with_it(tmp_path):
    """trainer.dropout_by_epoch=[0.0] with model.dropout=0.3: epoch 0 trains exactly as a model without
    dropout does, epoch 1 with 0.3 in every dropout (attention weights too); a run resumed in epoch 1 gets 0.3
    back from the schedule."""
    def modules_p(model):
        return {m.p for m in model.modules() if hasattr(m, "p")} | {
            m.dropout for m in model.modules() if hasattr(m, "out_proj")}

    common = ("trainer.max_steps=null", "trainer.val_every=1000", "checkpoint.every_steps=1000")
    sched = make_trainer(tmp_path / "s", *common, "trainer.max_epochs=1", "model.dropout=0.3",
                         "trainer.dropout_by_epoch=[0.0]")
    plain = make_trainer(tmp_path / "p", *common, "trainer.max_epochs=1", "model.dropout=0.0")
    assert sched.train() == 0 and plain.train() == 0
    assert modules_p(sched.model) == {0.0}
    for a, b in zip(sched.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b)
    resumed = make_trainer(tmp_path / "s", *common, "trainer.max_epochs=2", "model.dropout=0.3",
                           "trainer.dropout_by_epoch=[0.0]")
    assert resumed.train() == 0 and resumed.step == sched.step + resumed.data.num_train_batches(1)
    assert modules_p(resumed.model) == {0.3}
    # And it can fail: without the schedule, epoch 0 with 0.3 trains to other weights.
    other = make_trainer(tmp_path / "o", *common, "trainer.max_epochs=1", "model.dropout=0.3")
    assert other.train() == 0
    assert any(not torch.equal(a, b) for a, b in zip(other.model.parameters(), plain.model.parameters(), strict=True))


def test_changed_settings_lists_differences_but_not_the_run_length():
    saved = {"seed": 1, "trainer": {"max_minutes": 5.0, "clip_norm": 1.0}, "eval": {"tune_lenpen": [1.0, 1.2]}}
    now = {"seed": 2, "trainer": {"max_minutes": 9.0, "clip_norm": 1.0, "new_key": 3},
           "eval": {"tune_lenpen": [1.0]}, "hydra": {"run": {"dir": "x"}}}
    assert changed_settings(saved, now) == ["eval.tune_lenpen=[1.0, 1.2] -> [1.0]", "seed=1 -> 2",
                                            "trainer.new_key=<none> -> 3"]
    assert changed_settings(saved, saved) == []
    # A key an older version's config lacked changed nothing if it has its schema default now.
    older = {"logger": {"trackers": ["tensorboard"]}, "model": {"activation": "relu"}, "trainer": {"nonfinite": "stop"}}
    assert changed_settings({}, older) == ["trainer.nonfinite=<none> -> stop"]


def test_validation_time_stays_out_of_the_steps_tokens_per_s(tmp_path, monkeypatch, caplog):
    """A logged line's tokens/s is its steps' own: a validation between them (here one that takes 100 s of a
    shifted clock) goes to the valid record's val_s and the run clock's pauses, which the summary line names;
    the time left (eta_s) still counts it. Before, such a line's tokens/s fell by what validation took."""
    import time

    from transformer.training.loop import hotpath, quality, validation

    class Clock:  # the wall clock, plus what the fake validation "took"
        offset = 0.0

        @classmethod
        def time(cls):
            return time.time() + cls.offset

    for module in (hotpath, quality, validation):
        monkeypatch.setattr(module, "time", Clock)
    t = make_trainer(tmp_path, "trainer.max_steps=4", "trainer.max_epochs=null", "trainer.val_every=2",
                     "trainer.log_every=4", "checkpoint.every_steps=100")
    scores = t.validator.scores

    def slow(model, ema=None):
        Clock.offset += 100.0
        return scores(model, ema)

    monkeypatch.setattr(t.validator, "scores", slow)
    windows, read = [], hotpath.TrainWindow.read
    monkeypatch.setattr(hotpath.TrainWindow, "read", lambda self, g=None: windows.append(read(self, g)) or windows[-1])
    with caplog.at_level("INFO"):
        assert t.train() == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (train,) = [x for x in lines if x["split"] == "train"]  # steps 1-4; step 2's validation inside, step 4's after
    valid = [x for x in lines if x["split"] == "valid"]
    assert [x["step"] for x in valid] == [2, 4] and all(x["val_s"] >= 100.0 for x in valid)
    (w,) = windows
    assert w["wall"] >= 100.0 and w["elapsed"] < 20.0  # 4 steps of a tiny model: seconds at most
    assert train["tokens_per_s"] == pytest.approx(w["tokens"] / w["elapsed"])
    assert t.clock.paused["validation"] >= 200.0 and t.clock.paused["checkpoints"] > 0.0
    assert re.search(r"done: step 4, .* min \(validation 3\.[34] min, checkpoints 0\.\d min\)", caplog.text)
