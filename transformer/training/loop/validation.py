"""Validation as a component: the loss on the validation split, the task's decoding scores, the best score so
far and early stopping. The Trainer builds one `Validator` and calls it with the model and the step; the
Validator reads nothing of the Trainer. Collective: every rank calls it, each scores its shard of the split."""
import contextlib
import logging
import math
import time
from typing import Callable, ContextManager, Dict, Optional

import torch

from transformer.dist import DistEnv
from transformer.specials import PAD
from transformer.tasks import Metric, Task
from transformer.training.components.ema import EMA
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.loop.quality import RunClock, TimeToQuality
from transformer.training.reporting.logs import MetricsLogger

log = logging.getLogger(__name__)


def rng_untouched(device: torch.device):
    """Runs a block on a copy of the RNG state. Training draws (dropout masks) must depend only on the
    optimiser steps taken, not on when loader iterators were created or how often we validated:
    a resumed run creates its iterator mid-epoch and validates at its cut, an uninterrupted one
    does neither, and both must still end bit-identical."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


class Validator:
    """Scores a model on the validation split and keeps the best score so far.

    Its state is `best` (the best value of `metric` so far, None before the first validation) and
    `bad_validations` (validations since the last improvement): the Trainer writes both into its
    checkpoint under the same keys as always and restores them on resume.

    Args:
        task: what is scored beyond the loss (`Task.validate`) and which metrics exist.
        data: the DataModule; its `valid_loader()` yields the validation batches of this rank.
        env: the distributed environment (sums over ranks, rank 0's clock for all).
        metrics: the run's MetricsLogger; each validation is one "valid" record.
        metric: the declared metric that decides "best" (checkpoint.best_metric).
        label_smoothing: epsilon_ls of the validation loss, the training loss's (trainer.label_smoothing).
        patience: validations without improvement before early stopping (eval.patience); None: never.
        autocast: a context factory for the forward pass (the precision training runs in).
        clock: the run's clock; the minutes at each validation are logged and feed time to quality.
        quality: the time-to-quality record, updated with each validation's scores.
    """

    def __init__(self, task: Task, data, env: DistEnv, metrics: MetricsLogger, *, metric: Metric,
                 label_smoothing: float, patience: Optional[int],
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext, clock: RunClock,
                 quality: TimeToQuality):
        self.task, self.data, self.env, self.metrics = task, data, env, metrics
        self.metric, self.label_smoothing, self.patience = metric, label_smoothing, patience
        self.autocast, self.clock, self.quality = autocast, clock, quality
        self.best: Optional[float] = None
        self.bad_validations = 0
        self._last: Optional[tuple] = None  # (step, is_best) of the latest validation

    def __call__(self, model: torch.nn.Module, step: int, epoch: int, ema: Optional[EMA] = None) -> bool:
        """Validates `model` (the average of `ema` when given) at `step`, unless this step was validated
        already (an epoch or the run ending on a val_every step): a second, equal score would count as
        "not improved" and could trip early stopping.

        Returns:
            Whether the weights are the best so far (by `metric`).
        """
        if self._last is None or self._last[0] != step:
            self._last = (step, self.validate(model, step, epoch, ema))
        return self._last[1]

    @torch.no_grad()
    def evaluate_loss(self, model: torch.nn.Module, loader) -> Dict[str, float]:
        """Label-smoothed loss, NLL and perplexity per target token, summed over all ranks; collective."""
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.env.device)  # loss, nll: read once, at the end
        tokens = 0
        for batch in loader:
            batch = batch.to(self.env.device)
            with self.autocast():
                logits = model(batch.src, batch.tgt_in, packings=batch.packings)  # (B, T, V)
            loss, nll = label_smoothed_cross_entropy(logits, batch.tgt_out, self.label_smoothing, PAD)
            sums += torch.stack([loss, nll]).double()
            tokens += batch.n_tokens
        loss, nll, tokens = self.env.all_reduce_sum([*sums.tolist(), tokens])
        tokens = max(tokens, 1.0)
        return {"val_loss": loss / tokens, "val_nll": nll / tokens, "val_ppl": math.exp(min(nll / tokens, 50))}

    def scores(self, model: torch.nn.Module, ema: Optional[EMA] = None) -> Dict[str, float]:
        """Validation loss (summed over all ranks' tokens) and the task's decoding scores, of the weight
        average when `ema` is given; collective. The RNG state is left as it was."""
        with rng_untouched(self.env.device), (ema.swapped_in() if ema is not None else contextlib.nullcontext()):
            values = self.evaluate_loss(model, self.data.valid_loader())
            values.update(self.task.validate(model, self.data, self.env))
        return values

    def better(self, score: float) -> bool:
        """Whether `score` beats the best so far (the first score always does)."""
        if not math.isfinite(score):  # a NaN score never becomes best.pt (trainer.nonfinite)
            return False
        return self.best is None or (score > self.best if self.metric.higher_is_better else score < self.best)

    def validate(self, model: torch.nn.Module, step: int, epoch: int, ema: Optional[EMA] = None) -> bool:
        """Scores the weights, logs them (with val_s, the seconds it took) and updates best/bad_validations;
        returns whether they are the best."""
        start = time.time()
        values = self.scores(model, ema)
        values["val_s"] = round(time.time() - start, 2)
        # Rank 0's clock for all: the levels reached and the minutes logged are the same on every rank.
        minutes = round(self.env.broadcast_object(self.clock.seconds() / 60), 3)
        values["train_minutes"] = minutes
        values.update(self.quality.update(values, minutes))
        self.metrics.log("valid", step, epoch, **values)
        better = self.better(values[self.metric.name])
        if better:
            self.best, self.bad_validations = values[self.metric.name], 0
        else:
            self.bad_validations += 1
        return better

    def patience_over(self) -> bool:
        """Early stopping: eval.patience validations in a row without improvement."""
        if self.patience is not None and self.bad_validations >= self.patience:
            log.info("early stop: %s has not improved for %d validations (best %.4g)",
                     self.metric.name, self.bad_validations, self.best)
            return True
        return False
