"""The Validator as a component: built from its explicit inputs and called with a model and a step, with no
Trainer; and parallelize() as the one place the model is wrapped."""
import json

import torch

from tests.helpers.cli import compose_cfg
from tests.training.loop.test_trainer import SMALL
from transformer.data.copy import CopyData
from transformer.dist import DistEnv
from transformer.model import Transformer
from transformer.tasks import build_task
from transformer.training.components.ema import EMA
from transformer.training.distributed.parallelize import build_model, parallelize
from transformer.training.loop.quality import RunClock, TimeToQuality
from transformer.training.loop.validation import Validator
from transformer.training.reporting.logs import MetricsLogger


def build(tmp_path, *overrides):
    cfg = compose_cfg(*SMALL, "logger.trackers=[]", *overrides)  # metrics.jsonl only
    data = CopyData(cfg, cfg.seed, 0, 1)
    torch.manual_seed(0)
    model = build_model(cfg, data)
    task = build_task(cfg)
    metrics = MetricsLogger(tmp_path, cfg)
    validator = Validator(task, data, DistEnv(), metrics, metric=task.metric("val_loss"), label_smoothing=0.1,
                          patience=2, clock=RunClock(), quality=TimeToQuality(task.metrics().values()))
    return model, validator, metrics


def valid_records(tmp_path):
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "valid"]


def test_a_validator_alone_keeps_best_and_patience_and_validates_a_step_once(tmp_path):
    model, validator, metrics = build(tmp_path)
    rng = torch.get_rng_state()
    assert validator(model, step=1, epoch=0) is True  # the first score is the best so far
    assert torch.equal(torch.get_rng_state(), rng)  # validation leaves the training draws alone
    best = validator.best
    assert best == valid_records(tmp_path)[0]["val_loss"]
    assert validator(model, step=1, epoch=0) is True  # the same step again: no second validation
    assert len(valid_records(tmp_path)) == 1
    assert validator(model, step=2, epoch=0) is False  # an equal score has not improved
    assert (validator.best, validator.bad_validations) == (best, 1) and not validator.patience_over()
    assert validator(model, step=3, epoch=0) is False
    assert validator.patience_over()  # eval.patience=2 validations without improvement
    with torch.no_grad():
        model.generator.weight.mul_(0.0)  # uniform predictions: another loss (lower than the random init's)
    is_best = validator(model, step=4, epoch=0)
    new = valid_records(tmp_path)[-1]["val_loss"]
    assert new != best and is_best == (new < best)  # val_loss: lower is better
    assert (validator.best, validator.bad_validations) == ((new, 0) if is_best else (best, 3))
    assert [r["step"] for r in valid_records(tmp_path)] == [1, 2, 3, 4]
    metrics.close()


def test_the_validator_scores_the_weight_average_when_given_one(tmp_path):
    model, validator, metrics = build(tmp_path)
    ema = EMA(model, 0.5)
    plain = validator.scores(model)["val_loss"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)  # the model moves on; the average still holds the old weights
    moved = validator.scores(model)["val_loss"]
    assert validator.scores(model, ema)["val_loss"] == plain != moved
    metrics.close()


def test_the_end_of_run_average_is_scored_as_it_is_not_with_the_live_ema(tmp_path):
    """checkpoint.average_last with trainer.ema_decay: the average file already holds the checkpoints' weight
    averages (model_weights), so its validation scores it, not the run's live EMA swapped in over it."""
    from transformer.training.components.checkpoint import FORMAT, Checkpointer, atomic_save, load_checkpoint
    from transformer.training.loop.run_end import average_last

    model, validator, metrics = build(tmp_path)
    ema = EMA(model, 0.5)
    checkpointer = Checkpointer(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05)
        ema.update()
        if step == 3:
            break  # a step after the last checkpoint: the live average is neither checkpoint's
        state = {"format": FORMAT, "model_args": model.args.to_dict(), "model": model.state_dict(),
                 "ema": ema.state_dict(),
                 "tokenizer": validator.data.tokenizer.state_dict(), "trainer": {"step": step, "epoch": 0}}
        atomic_save(state, checkpointer.folder / f"step_{step:08d}.pt")
    average_last(model, validator, 2, env=DistEnv(), checkpointer=checkpointer, run_dir=tmp_path, metrics=metrics,
                 step=2, epoch=0)
    metrics.close()
    averaged = load_checkpoint(checkpointer.folder / "average_last2.pt")["model"]
    model.load_state_dict(averaged)
    logged = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "average"]
    assert logged[0]["val_loss"] == validator.scores(model)["val_loss"] != validator.scores(model, ema)["val_loss"]


def test_parallelize_wraps_nothing_on_one_cpu_worker_and_keeps_parameter_names(tmp_path):
    cfg = compose_cfg(*SMALL, "trainer.activation_checkpointing=true", "trainer.precision=fp16")
    model = Transformer.from_config(cfg.model, 16, 16)
    names = list(model.state_dict())
    p = parallelize(model, cfg, DistEnv())
    assert p.net is p.model is model and list(p.model.state_dict()) == names
    assert p.amp_dtype is None and not p.scaler.is_enabled()  # fp16 has no CPU kernels: fp32 there


def test_build_model_gives_the_trainers_options_and_parallelize_refuses_a_model_without_them():
    """trainer.bf16_residual and unpadded_attention are constructor options (ModelOptions), not flags set on a
    built model: build_model passes them, every layer holds them from the start, the checkpoint's model args
    stay as they were, and parallelize refuses a model built without what the config asks."""
    import pytest

    from transformer.model import ModelOptions

    cfg = compose_cfg(*SMALL, "trainer.bf16_residual=true", "trainer.unpadded_attention=true")
    data = CopyData(cfg, cfg.seed, 0, 1)
    torch.manual_seed(0)
    model = build_model(cfg, data)
    assert model.options == ModelOptions(bf16_residual=True, unpadded_attention=True) and model.unpadded_attention
    assert all(m.bf16_residual for m in model.modules() if hasattr(m, "bf16_residual"))
    torch.manual_seed(0)
    plain = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
    assert plain.args == model.args and "options" not in plain.args.to_dict()
    pairs = zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match="built with ModelOptions.*build_model"):
        parallelize(plain, cfg, DistEnv())
