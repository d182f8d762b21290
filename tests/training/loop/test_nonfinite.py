"""trainer.nonfinite: a step whose loss or gradients are not finite has its update skipped on the device (no host
sync); more than trainer.nonfinite_skips in a row stop the run with exit code 4 and one line naming the step,
the learning rate and the last finite checkpoint; no checkpoint of non-finite weights is ever written. Under
DDP the flag is all-reduced, so a NaN on one rank of two stops both at the same step."""
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.cli import compose_cfg, free_port
from tests.helpers.dist import TINY, join_gloo
from tests.helpers.inprocess import call_main
from tests.helpers.models import one_thread  # noqa: F401  (autouse)
from tests.training.loop.test_trainer import SMALL, make_trainer
from transformer import dist, exit_codes
from transformer.cli import train as train_cli
from transformer.data.copy import CopyData
from transformer.model import Transformer
from transformer.tasks import build_task
from transformer.training.components import loss as loss_module  # the steps call its loss (forward_backward)
from transformer.training.components.checkpoint import load_checkpoint
from transformer.training.loop.hotpath import LaggedFlag
from transformer.training.loop.nonfinite import Diverged
from transformer.training.loop.trainer import Trainer


def nan_from(t: Trainer, step: int, monkeypatch) -> None:
    """The loss of every step after `step` is NaN (so are its gradients)."""
    real = loss_module.label_smoothed_cross_entropy

    def loss(*args, **kwargs):
        value, nll = real(*args, **kwargs)
        return (value * math.nan, nll) if t.step >= step else (value, nll)

    monkeypatch.setattr(loss_module, "label_smoothed_cross_entropy", loss)


def weights(t: Trainer) -> dict:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


LAG = getattr(LaggedFlag(), "lag", 1)  # steps between a flag and its reading (transformer/training/loop/hotpath.py)


@pytest.mark.parametrize("policy, skips, stop_step", [("skip", 2, 5 + LAG), ("stop", 5, 3 + LAG)])
def test_nonfinite_steps_are_skipped_then_the_run_stops_with_one_line(tmp_path, monkeypatch, caplog, policy,
                                                                      skips, stop_step):
    """Steps 3, 4, ... (counted from 1) are NaN. Their flags are read LAG steps late: with 2 skips allowed, step 5
    is the third in a row, read (and the run stopped) after step 5 + LAG; with `stop`, after step 3 + LAG."""
    t = make_trainer(tmp_path, "trainer.max_steps=30", "trainer.max_epochs=null", "trainer.val_every=1000",
                     "checkpoint.every_steps=2", f"trainer.nonfinite={policy}", f"trainer.nonfinite_skips={skips}")
    nan_from(t, 2, monkeypatch)
    snapshots = {}
    save = t.save
    monkeypatch.setattr(t, "save", lambda best: (snapshots.setdefault(t.step, weights(t)), save(best)))
    with caplog.at_level(logging.INFO):
        code = t.train()
    assert code == exit_codes.DIVERGED and t.step == stop_step
    # Skipped updates leave the weights and Adam's moments as they were after step 2.
    assert all(torch.equal(v, snapshots[2][k]) for k, v in t.model.state_dict().items())
    assert all(int(s["step"]) == 2 for s in t.optimizer.state.values())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training diverged")]
    assert len(lines) == 1, lines
    last = t.checkpointer.step_files()[0][1]
    assert f"stopped at step {stop_step}, learning rate {t.scheduler.lr():.4g}" in lines[0]
    assert f"last finite checkpoint: {last}" in lines[0] and "exit code 4" in lines[0]
    assert ("steps 3-5 " if policy == "skip" else "at step 3 ") in lines[0]
    for name in ("last.pt", "best.pt", *(p.name for _, p in t.checkpointer.step_files())):
        path = t.checkpointer.folder / name
        if path.exists():
            assert all_finite(load_checkpoint(path)["model"]), name


def test_a_finite_step_resets_the_count(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, "trainer.max_steps=12", "trainer.max_epochs=null", "trainer.val_every=1000",
                     "trainer.nonfinite_skips=2")
    real = loss_module.label_smoothed_cross_entropy

    def loss(*args, **kwargs):  # two NaN steps, one finite, two NaN, ...: never three in a row
        value, nll = real(*args, **kwargs)
        return (value * math.nan, nll) if t.step % 3 != 2 else (value, nll)

    monkeypatch.setattr(loss_module, "label_smoothed_cross_entropy", loss)
    assert t.train() == 0 and all_finite(t.model.state_dict())


def test_non_finite_weights_are_never_saved(tmp_path):
    t = make_trainer(tmp_path)
    with torch.no_grad():
        next(t.model.parameters())[0] = math.inf
    with pytest.raises(Diverged, match="weights are not finite"):
        t.save(is_best=True)
    assert t.checkpointer.step_files() == []


def test_bad_policy_is_refused():
    from transformer.config import ConfigError
    from transformer.config_checks import validate

    with pytest.raises(ConfigError, match="trainer.nonfinite"):
        validate(compose_cfg(*SMALL, "trainer.nonfinite=ignore"))


def test_the_diverging_copy_run_exits_4_with_finite_checkpoints(tmp_path):
    """The issue's repro (`optim.factor=1e6`): it used to end 'done', exit 0, with NaN weights as best.pt.
    transformer-train's main() in this process: the same command line without an interpreter start."""
    run = tmp_path / "run"
    res = call_main(train_cli.main, [*TINY, f"hydra.run.dir={run}", "optim.factor=1e6", "trainer.max_steps=200",
                                     "trainer.val_every=5", "checkpoint.every_steps=5", "logger.trackers=[]"],
                    tmp_path, prog="transformer-train")
    assert res.returncode == exit_codes.DIVERGED, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if "training diverged" in ln]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "learning rate" in lines[0] and f"last finite checkpoint: {run}/checkpoints/step_" in lines[0]
    assert "done:" not in res.stderr
    for path in (run / "checkpoints").glob("*.pt"):
        assert all_finite(load_checkpoint(path)["model"]), path


def wrap(model, cfg, env):
    """The model as Trainer takes it: parallelize(model, cfg, env) where that exists (it wraps for DDP)."""
    try:
        from transformer.training.distributed.parallelize import parallelize
    except ImportError:  # Trainer wraps the model itself
        return model
    return parallelize(model, cfg, env)


def _nan_on_one_rank(rank: int, port: int, run_dir: str):
    torch.set_num_threads(1)
    env = join_gloo(rank, 2, port)
    try:
        cfg = compose_cfg(*SMALL, "trainer.max_steps=30", "trainer.max_epochs=null", "trainer.val_every=1000",
                          "checkpoint.every_steps=1000", "trainer.nonfinite_skips=2")
        data = CopyData(cfg, cfg.seed, rank, 2)
        torch.manual_seed(0)
        model = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
        t = Trainer(cfg, env, wrap(model, cfg, env), data, build_task(cfg), Path(run_dir))
        if rank == 1:
            real = loss_module.label_smoothed_cross_entropy

            def loss(*args, **kwargs):
                value, nll = real(*args, **kwargs)
                return (value * math.nan, nll) if t.step >= 2 else (value, nll)

            loss_module.label_smoothed_cross_entropy = loss
        code = t.train()
        digest = sum(float(v.double().sum()) for v in t.model.state_dict().values())
        Path(run_dir, f"rank{rank}.json").write_text(json.dumps({"code": code, "step": t.step, "weights": digest}))
        t.close()
    finally:
        dist.close()


@pytest.mark.distributed
def test_nan_on_one_rank_of_two_stops_both_at_the_same_step(tmp_path):
    mp.start_processes(_nan_on_one_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1] and got[0]["code"] == exit_codes.DIVERGED and got[0]["step"] == 5 + LAG
    assert math.isfinite(got[0]["weights"])
