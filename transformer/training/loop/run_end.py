"""The end of a run: the average of the last checkpoints (scored on validation; best.pt if it wins), the task's
final scores with best.pt's weights, the figures and the one-line summary. Functions of what they use, not
of the Trainer. Collective where marked: every rank calls them, rank 0 alone writes."""
import logging
from pathlib import Path
from typing import Optional

import torch

from transformer.config import to_container
from transformer.dist import DistEnv, rank_zero
from transformer.tasks import Task
from transformer.training.components.checkpoint import (
    Checkpointer,
    atomic_link,
    atomic_save,
    load_checkpoint,
    model_weights,
)
from transformer.training.loop.quality import RunClock
from transformer.training.loop.validation import Validator
from transformer.training.reporting.logs import MetricsLogger

log = logging.getLogger(__name__)


def end_of_run(model: torch.nn.Module, validator: Validator, *, cfg, env: DistEnv, task: Task, data,
               checkpointer: Optional[Checkpointer], metrics: MetricsLogger, run_dir: Optional[Path], step: int,
               epoch: int, clock: RunClock) -> None:
    """What follows the last training step of a run that ended normally; collective.

    checkpoint.average_last (see `average_last`), then the task's final scores (the copy task: accuracy on
    fresh sequences) with the weights of best.pt, chosen on the validation split as for any model selection
    (eval.tune_lenpen tunes decoding on them first), then the figures and the summary line.

    Args:
        model: the trained model (not wrapped); it holds best.pt's weights afterwards.
        validator: scores the average and holds the best score so far (updated when the average wins).
        cfg: the run's config (checkpoint.average_last; the figures' eval settings).
        env: the distributed environment.
        task: the final scores (`Task.test`) and decoding tuning (`Task.tune`).
        data: the DataModule (tokenizer, splits).
        checkpointer: the run's checkpoint folder; None on ranks other than 0 and without a run directory.
        metrics: the MetricsLogger that gets the "average", "tune" and "test" records.
        run_dir: the run directory (None on ranks other than 0).
        step, epoch: where training ended, for the records.
        clock: the run's clock, for the summary.
    """
    average_last(model, validator, cfg.checkpoint.average_last, env=env, checkpointer=checkpointer,
                 run_dir=run_dir, metrics=metrics, step=step, epoch=epoch)
    best = checkpointer.folder / "best.pt" if checkpointer is not None else None
    path = env.broadcast_object(str(best) if best is not None and best.is_file() else None)
    if path is not None:
        ckpt = load_checkpoint(path)
        model.load_state_dict(model_weights(ckpt))
        tune_decoding(model, task, data, env, metrics, checkpointer, path, ckpt, step, epoch)
    values = task.test(model, data, env)
    if values:
        metrics.log("test", step, epoch, **values, checkpoint="best" if path else "last")
    _log_figures(metrics, cfg, run_dir, model, task, data, step)
    _summary(validator, checkpointer, path, step, epoch, clock)


def average_last(model: torch.nn.Module, validator: Validator, K: int, *, env: DistEnv,
                 checkpointer: Optional[Checkpointer], run_dir: Optional[Path], metrics: MetricsLogger, step: int,
                 epoch: int) -> None:
    """checkpoint.average_last=K: the average of the last K checkpoints (as `transformer-average RUN --last
    K` writes it) is saved as checkpoints/average_lastK.pt and scored on validation; if it beats the best
    checkpoint on checkpoint.best_metric, best.pt becomes it. `model` holds the average afterwards. Collective.
    With trainer.ema_decay the checkpoints' weight averages are what is averaged (`model_weights`), so the
    average is scored as it is: the run's live EMA is not swapped in over it."""
    if K < 2:
        return
    path = env.broadcast_object(_write_average(checkpointer, run_dir, K))
    if path is None:
        return
    model.load_state_dict(load_checkpoint(path)["model"])
    values = validator.scores(model)
    metrics.log("average", step, epoch, **values, checkpoints=K)
    name = validator.metric.name
    if validator.better(values[name]):
        validator.best = values[name]
        _link_best(checkpointer, path, name)


@rank_zero
def _write_average(checkpointer: Optional[Checkpointer], run_dir: Optional[Path], K: int) -> Optional[str]:
    if checkpointer is None or len(checkpointer.step_files()) < K:
        log.warning("checkpoint.average_last=%d: fewer checkpoints than that were kept; nothing averaged", K)
        return None
    from transformer.training.components.averaging import average_checkpoints, last_checkpoints

    out = checkpointer.folder / f"average_last{K}.pt"
    atomic_save(average_checkpoints(last_checkpoints(run_dir, K)), out)
    return str(out)


@rank_zero
def _link_best(checkpointer: Checkpointer, path: str, metric: str) -> None:
    atomic_link(Path(path), checkpointer.folder / "best.pt")
    log.info("best.pt is now %s (better %s than every single checkpoint)", path, metric)


def tune_decoding(model: torch.nn.Module, task: Task, data, env: DistEnv, metrics: MetricsLogger,
                  checkpointer: Optional[Checkpointer], best: str, ckpt: dict, step: int, epoch: int) -> None:
    """eval.tune_lenpen: the task scores best.pt's weights (`ckpt`, loaded into `model`) on validation at each
    length penalty; the choice goes into best.pt as ckpt["decoding"], which transformer-evaluate/translate
    apply over the saved eval config. Collective."""
    tuned = task.tune(model, data, env)
    if tuned is not None:
        metrics.log("tune", step, epoch, **tuned)
        _store_decoding(checkpointer, Path(best), ckpt, tuned)


@rank_zero
def _store_decoding(checkpointer: Checkpointer, best: Path, ckpt: dict, tuned: dict) -> None:
    # best.pt is a hard link: rewrite the file it shares, then point every link to it at the new file.
    target = checkpointer.target(best)
    links = [p for p in (best, checkpointer.folder / "last.pt") if p != target and p.exists() and p.samefile(target)]
    ckpt["decoding"] = {"lenpen": tuned["lenpen"], "chosen_on": "validation BLEU",
                        "val_bleu": {k: v for k, v in tuned.items() if k != "lenpen"}}
    atomic_save(ckpt, target)
    for link in links:
        atomic_link(target, link)
    log.info("lenpen %g chosen on validation (eval.tune_lenpen), stored in %s", tuned["lenpen"], target)


@rank_zero
def _summary(validator: Validator, checkpointer: Optional[Checkpointer], best: Optional[str], step: int, epoch: int,
             clock: RunClock) -> None:
    chosen = checkpointer.target(Path(best)) if best else "no checkpoint"  # best.pt links to it
    log.info("done: step %d, epoch %d, %.1f min (%s) | best %s=%s: %s (chosen by checkpoint.best_metric on the "
             "validation split) | time to quality: %s", step, epoch, clock.seconds() / 60, clock.split(),
             validator.metric.name,
             f"{validator.best:.4g}" if validator.best is not None else "n/a", chosen, validator.quality.summary())


@rank_zero
def _log_figures(metrics: MetricsLogger, cfg, run_dir: Optional[Path], model: torch.nn.Module, task: Task, data,
                 step: int) -> None:
    """Loss/score/rate curves and the attention maps of a validation sentence, as TensorBoard images
    (`transformer-plot RUN_DIR` draws the same as PNG files)."""
    if metrics.writer is None:
        return
    from transformer.training.reporting.plots import log_figures

    log_figures(metrics.writer, run_dir=run_dir, cfg=to_container(cfg), model=model, tokenizer=data.tokenizer,
                sentence=task.sample_sentence(data), step=step, ev=cfg.eval)
