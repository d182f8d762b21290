"""Validation, a part of the Trainer: the loss on the validation split, the task's decoding scores, the best
score so far and early stopping. Collective: every rank calls these, each scores its shard of the split."""
import contextlib
import logging
import math

import torch

from transformer.specials import PAD
from transformer.training.loss import label_smoothed_cross_entropy

log = logging.getLogger(__name__)


class Validation:
    """Mixed into Trainer; uses its cfg, tcfg, env, model, data, task, ema, metric, metrics, clock,
    quality, step, epoch, best, bad_validations, _last_val, autocast() and _rng_untouched()."""

    @torch.no_grad()
    def evaluate_loss(self, loader) -> dict:
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.env.device)  # loss, nll: read once, at the end
        tokens = 0
        for batch in loader:
            batch = batch.to(self.env.device)
            with self.autocast():
                logits = self.model(batch.src, batch.tgt_in)
            loss, nll = label_smoothed_cross_entropy(logits, batch.tgt_out, self.tcfg.label_smoothing, PAD)
            sums += torch.stack([loss, nll]).double()
            tokens += batch.n_tokens
        loss, nll, tokens = self.env.all_reduce_sum([*sums.tolist(), tokens])
        tokens = max(tokens, 1.0)
        return {"val_loss": loss / tokens, "val_nll": nll / tokens, "val_ppl": math.exp(min(nll / tokens, 50))}

    def _validate_once(self) -> bool:
        """validate(), unless this step was validated already (an epoch or the run ending on a val_every
        step): a second, equal score would count as "not improved" and could trip early stopping."""
        if self._last_val is None or self._last_val[0] != self.step:
            self._last_val = (self.step, self.validate())
        return self._last_val[1]

    def scores(self) -> dict:
        """Validation loss (summed over all ranks' tokens) and the task's decoding scores, of the weight
        average when trainer.ema_decay is on; collective."""
        with self._rng_untouched(), (self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()):
            values = self.evaluate_loss(self.data.valid_loader())
            values.update(self.task.validate(self.model, self.data, self.env))
        return values

    def _better(self, score: float) -> bool:
        if not math.isfinite(score):  # a NaN score never becomes best.pt (trainer.nonfinite)
            return False
        return self.best is None or (score > self.best if self.metric.higher_is_better else score < self.best)

    def validate(self) -> bool:
        """Scores the current weights; returns whether they are the best so far."""
        values = self.scores()
        # Rank 0's clock for all: the levels reached and the minutes logged are the same on every rank.
        minutes = round(self.env.broadcast_object(self.clock.seconds() / 60), 3)
        values["train_minutes"] = minutes
        values.update(self.quality.update(values, minutes))
        self.metrics.log("valid", self.step, self.epoch, **values)
        better = self._better(values[self.metric.name])
        if better:
            self.best, self.bad_validations = values[self.metric.name], 0
        else:
            self.bad_validations += 1
        return better

    def _patience_over(self) -> bool:
        patience = self.cfg.eval.patience
        if patience is not None and self.bad_validations >= patience:
            log.info("early stop: %s has not improved for %d validations (best %.4g)",
                     self.metric.name, self.bad_validations, self.best)
            return True
        return False
