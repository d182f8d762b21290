"""What a dataset asks of training: the scores it measures, how validation computes them, and what is
reported once training ends. The trainer only calls these; it never asks which dataset it has."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from transformer.config import ConfigError


@dataclass(frozen=True)
class Metric:
    name: str  # the key in metrics.jsonl and in checkpoint.best_metric, e.g. "val_bleu"
    higher_is_better: bool
    levels: Tuple[float, ...] = ()  # quality levels whose time to reach is logged (minutes_to_val_bleu_30, ...)


VAL_LOSS = Metric("val_loss", higher_is_better=False)  # every task: the trainer computes it


class Task:
    name = "task"

    def __init__(self, cfg):
        self.cfg = cfg

    def scores(self) -> List[Metric]:
        """The validation scores this task computes by decoding (beyond the loss)."""
        return []

    def metrics(self) -> Dict[str, Metric]:
        return {m.name: m for m in [VAL_LOSS, *self.scores()]}

    def metric(self, name: str) -> Metric:
        """The declared metric `name` (checkpoint.best_metric); ConfigError naming the key otherwise."""
        known = self.metrics()
        if name not in known:
            raise ConfigError(f"checkpoint.best_metric={name!r}: the {self.name} task of this run measures "
                              f"{', '.join(known)}")
        return known[name]

    def validate(self, model, data, env) -> Dict[str, float]:
        """Decoding scores on the validation split; collective (every rank calls it, all get the same)."""
        return {}

    def tune(self, model, data, env) -> Optional[Dict[str, float]]:
        """Decoding settings chosen on the validation split for the final model (eval.tune_lenpen), as
        {"lenpen": value, score keys...}; None when the task tunes nothing. Collective."""
        return None

    def test(self, model, data, env) -> Optional[Dict[str, float]]:
        """Final scores once training ends, of the model selected on validation (best.pt); collective."""
        return None

    def sample_sentence(self, data) -> Optional[str]:
        """A source sentence whose attention maps are drawn at the end of training."""
        return None
