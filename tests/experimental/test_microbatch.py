"""trainer.micro_batch=fit (transformer/experimental/microbatch.py): the split arithmetic, the search against an
injected memory model, the agreement of all ranks, the refusal, the CPU no-op and the exact resume."""
import logging

import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.training.loop.test_trainer import make_trainer
from transformer.config import ConfigError
from transformer.config_checks import validate
from transformer.dist import DistEnv
from transformer.experimental.microbatch import (
    Split,
    candidates,
    choose,
    first_fit,
    fit_micro_batch,
    probe_batch,
    resplit,
    worst_shape,
)
from transformer.specials import PAD
from transformer.training.components.checkpoint import load_checkpoint


class OtherRanks(DistEnv):
    """One rank of a job whose other ranks answer `others` to the all-reduce (max)."""

    def __init__(self, others):
        super().__init__()
        self.others = others

    def all_reduce_max(self, values):
        return [max(v, *o) for v, o in zip(values, zip(*self.others, strict=True), strict=True)]


class Budget:
    """The fake memory model: micro-batches of at most `limit` tokens fit; counts the probes."""

    def __init__(self, limit):
        self.limit, self.asked = limit, []

    def __call__(self, tokens):
        self.asked.append(tokens)
        return tokens <= self.limit


def test_resplit_keeps_the_tokens_per_update():
    s = Split(3300, 8)
    assert [(resplit(s, k).max_tokens, resplit(s, k).accumulate) for k in (1, 2, 3, 8, 16)] == [
        (26400, 1), (13200, 2), (8800, 3), (3300, 8), (1650, 16)]
    assert resplit(s, 7).max_tokens == 3771  # floored: never a budget above what was probed
    ramp = resplit(Split(2048, 2, (512, 1024)), 1)
    assert (ramp.max_tokens, ramp.max_tokens_by_epoch, ramp.largest) == (4096, (1024, 2048), 4096)
    assert Split.from_dict(ramp.to_dict()) == ramp


def test_candidates_hold_the_longest_example_and_keep_the_update_within_tolerance():
    s = Split(100, 3)
    ks = [c.accumulate for c in candidates(s, longest=30, tolerance=0.0)]
    assert ks == [1, 2, 3, 4, 5, 6, 10]  # 300 tokens shared exactly, each budget >= 30
    ks = [c.accumulate for c in candidates(s, longest=30, tolerance=0.015)]
    assert ks == [1, 2, 3, 4, 5, 6, 8, 9, 10]  # 7 x 42 = 294 (-2 %) is out, 8 x 37 (-1.3 %) and 9 x 33 are in
    assert all(c.max_tokens >= 30 for c in candidates(s, 30, 0.05))


def test_binary_search_finds_the_largest_fitting_micro_batch_in_few_probes():
    splits = candidates(Split(3300, 8), longest=200, tolerance=0.01)
    for limit, k in [(30000, 1), (26400, 1), (26399, 2), (9000, 3), (3300, 8), (2000, 14)]:
        fits = Budget(limit)
        i = first_fit(splits, fits)
        assert splits[i].accumulate == k and splits[i].max_tokens <= limit
        assert all(s.max_tokens > limit for s in splits[:i])  # nothing larger fits
        assert len(fits.asked) <= len(splits).bit_length() + 1
    assert first_fit(splits, Budget(100)) is None


def test_worst_shape_bounds_every_batch_of_the_budget():
    for budget, longest in [(3300, 256), (256, 256), (26400, 7), (100, 33)]:
        B, T = worst_shape(budget, longest)
        assert T == longest and B * T >= budget and (B - 1) * T < budget
    b = probe_batch(3, 5, packed=True)
    assert b.src.shape == b.tgt_in.shape == (3, 5) and not (b.tgt_out == PAD).any()
    assert b.packings[0].cu_seqlens.tolist() == [0, 5, 10, 15]


def test_all_ranks_take_the_smallest_micro_batch():
    s = Split(3300, 8)
    alone = choose(s, 200, 0.01, Budget(30000), DistEnv())
    assert (alone.max_tokens, alone.accumulate) == (26400, 1)
    splits = candidates(s, 200, 0.01)
    tight = first_fit(splits, Budget(9000))  # another rank's GPU holds 8,800-token micro-batches at most
    both = choose(s, 200, 0.01, Budget(30000), OtherRanks([[tight]]))
    assert (both.max_tokens, both.accumulate) == (8800, 3)
    with pytest.raises(ValueError, match=r"^trainer.micro_batch=fit: not even .* fit in GPU memory"):
        choose(s, 200, 0.01, Budget(30000), OtherRanks([[len(splits)]]))  # a rank where nothing fits


def _gloo_rank(rank: int, world_size: int, port: int, limits, out: str) -> None:
    import json

    from tests.helpers.dist import join_gloo
    from transformer import dist
    env = join_gloo(rank, world_size, port)
    try:
        try:
            chosen = choose(Split(3300, 8), 200, 0.01, Budget(limits[rank]), env).to_dict()
        except ValueError as e:
            chosen = str(e)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(chosen, f)
    finally:
        dist.close()


@pytest.mark.distributed
@pytest.mark.parametrize("limits, expect", [((30000, 9000), (8800, 3)), ((9000, 100), None)])
def test_two_gloo_ranks_agree_on_the_smaller_gpu(tmp_path, limits, expect):
    """Two real gloo workers whose GPUs (fake memory models) hold 30,000 and 9,000 tokens: both run 3 x 8,800;
    when nothing fits on one of them, both refuse."""
    import json

    import torch.multiprocessing as mp

    from tests.helpers.cli import free_port
    mp.spawn(_gloo_rank, args=(2, free_port(), limits, str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    if expect is None:
        assert r0.startswith("trainer.micro_batch=fit: not even")
    else:
        assert (r0["max_tokens"], r0["accumulate"]) == expect


def test_refused_in_one_line_when_nothing_fits():
    with pytest.raises(ValueError) as e:
        choose(Split(3300, 8), 200, 0.01, Budget(100), DistEnv())
    assert "\n" not in str(e.value) and "data.max_tokens" in str(e.value)


def test_config_keys_are_checked():
    validate(compose_cfg("trainer.micro_batch=fit", "trainer.micro_batch_margin=0.2"))
    for bad in ("trainer.micro_batch=auto", "trainer.micro_batch_margin=1.0", "trainer.micro_batch_tolerance=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            validate(compose_cfg(bad))


def test_on_a_cpu_it_only_logs_one_line(tmp_path, caplog):
    t = make_trainer(tmp_path, "trainer.micro_batch=fit", "trainer.accumulate=4")
    with caplog.at_level(logging.INFO, logger="transformer.experimental.microbatch"):
        fit_micro_batch(t)
    assert t.accumulate == 4 and t.data.train_sampler.max_tokens == 200 and t.micro_batch is None
    assert [r.getMessage() for r in caplog.records if r.name == "transformer.experimental.microbatch"] == [
        "trainer.micro_batch=fit: no CUDA device, nothing probed: data.max_tokens=200 and trainer.accumulate=4 "
        "as given"]
    fixed = make_trainer(tmp_path / "fixed", "trainer.accumulate=4")
    fit_micro_batch(fixed, fits=Budget(0))  # trainer.micro_batch=fixed: never probes
    assert fixed.accumulate == 4


def run(tmp_path, steps, fits, ckpt=None):
    tmp_path.mkdir(exist_ok=True)
    t = make_trainer(tmp_path, "trainer.micro_batch=fit", "trainer.accumulate=4", "trainer.max_epochs=null",
                     f"trainer.max_steps={steps}", "trainer.val_every=1000", "checkpoint.every_steps=3",
                     "trainer.val_epoch_end=false")
    if ckpt is not None:
        t.load_state_dict(load_checkpoint(ckpt))
    fit_micro_batch(t, fits=fits)
    assert t.train() == 0
    return t


def test_the_choice_is_applied_checkpointed_and_reused_on_resume(tmp_path, caplog):
    """A fitted run trains with the chosen split and keeps the tokens per update; its checkpoint records the
    choice; the run resumed from it reuses the choice without probing and ends with the weights of the
    uninterrupted run, bit for bit."""
    fits = Budget(400)
    whole = run(tmp_path / "whole", 6, fits)
    assert (whole.accumulate, whole.data.train_sampler.max_tokens) == (2, 400)  # 4 x 200 = 2 x 400
    assert fits.asked and max(fits.asked) > 400
    ckpt = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.pt")
    assert ckpt["trainer"]["micro_batch"] == {"max_tokens": 400, "accumulate": 2, "max_tokens_by_epoch": []}

    run(tmp_path / "half", 3, Budget(400))

    def never(tokens):
        raise AssertionError("a resumed run probes nothing")

    with caplog.at_level(logging.INFO, logger="transformer.experimental.microbatch"):
        resumed = run(tmp_path / "half", 6, never, ckpt=tmp_path / "half" / "checkpoints" / "last.pt")
    assert "as chosen when this run started, from its checkpoint" in caplog.text
    assert "tokens per update 1 x 4 x 200 = 800 -> 1 x 2 x 400 = 800" in caplog.text
    assert resumed.step == whole.step == 6 and resumed.accumulate == 2
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_without_a_choice_keeps_its_batches(tmp_path, caplog):
    (tmp_path / "again").mkdir()
    t = make_trainer(tmp_path, "trainer.accumulate=4", "trainer.max_epochs=null", "trainer.max_steps=2",
                     "trainer.val_every=1000", "checkpoint.every_steps=2", "trainer.val_epoch_end=false")
    assert t.train() == 0
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    del ckpt["trainer"]["micro_batch"]  # as earlier versions wrote it
    again = make_trainer(tmp_path / "again", "trainer.micro_batch=fit", "trainer.accumulate=4")
    again.load_state_dict(ckpt)
    with caplog.at_level(logging.INFO, logger="transformer.experimental.microbatch"):
        fit_micro_batch(again, fits=Budget(0))
    assert again.accumulate == 4 and "written without it" in caplog.text


def test_probe_step_on_a_cpu_with_a_fake_allocator(tmp_path, monkeypatch):
    """The probe's own code path on a CPU, CUDA's memory functions replaced by a fake allocator whose peak is
    the probe batch's token count: forward, loss, backward and Adam step run at the worst shape; the answers
    follow the peak against (1 - margin) x total; afterwards the weights, the optimiser (no state) and the RNG
    are as before, and fit_micro_batch applies the choice."""
    from types import SimpleNamespace

    from transformer.experimental import microbatch

    seen = []
    real_probe_batch, real_fork = microbatch.probe_batch, torch.random.fork_rng

    def probe_batch(B, T, packed):
        seen.append((B, T, packed))
        return real_probe_batch(B, T, packed)

    monkeypatch.setattr(microbatch, "probe_batch", probe_batch)
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: real_fork(devices=[]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1000))
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: seen[-1][0] * seen[-1][1])

    t = make_trainer(tmp_path, "trainer.micro_batch=fit", "trainer.accumulate=4", "trainer.unpadded_attention=true")
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    rng = torch.get_rng_state()
    probe = microbatch.MemoryProbe(t)  # limit: 0.9 x 1000
    longest = probe.longest
    assert probe(800) == (worst_shape(800, longest)[0] * longest <= 900)
    assert not probe(1000)
    assert seen[-1] == (*worst_shape(1000, longest), True)  # unpadded attention: a packed probe batch
    assert all(p.grad is None for p in t.model.parameters()) and t.optimizer.state  # Adam stepped, grads freed
    probe.close()
    assert not t.optimizer.state and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    fit_micro_batch(t, fits=microbatch.MemoryProbe(t))
    assert t.accumulate * t.data.train_sampler.max_tokens <= 800 and t.data.train_sampler.max_tokens <= 900
    assert t.accumulate == min(c.accumulate for c in candidates(Split(200, 4), longest, 0.01)
                               if worst_shape(c.max_tokens, longest)[0] * longest <= 900)
    assert not t.optimizer.state and all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())


@pytest.mark.gpu
def test_gpu_fit_probes_chooses_and_leaves_the_model_as_it_was(tmp_path):
    """On a GPU, the real probe: the tiny copy model's micro-batches of 4 x 200 tokens fit in one, the update
    size is kept; the weights, the (empty) optimiser state and the RNG states are as they were; a probe whose
    margin leaves no memory says no."""
    from tests.tiers.test_gpu import make_trainer as gpu_trainer
    from transformer.experimental.microbatch import MemoryProbe

    t = gpu_trainer(tmp_path, "bf16", "trainer.micro_batch=fit", "trainer.accumulate=4", "data.max_tokens=200")
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    rngs = torch.get_rng_state(), torch.cuda.get_rng_state()
    fit_micro_batch(t)
    assert (t.accumulate, t.data.train_sampler.max_tokens) == (1, 800) and t.micro_batch["accumulate"] == 1
    assert not t.optimizer.state and all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rngs[0]) and torch.equal(torch.cuda.get_rng_state(), rngs[1])
    probe = MemoryProbe(t)
    assert probe(200)
    probe.limit = 0
    assert not probe(200)
    probe.close()
