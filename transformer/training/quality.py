"""Time to quality: the run's wall clock (training and validation, summed over resumes) and the minutes at
which each validation score first reached the levels its task declares (BLEU 30, 35, 38, 40; ...), so
recipes are compared by the time they take, not only by where they end."""
import time
from typing import Dict, Iterable, Optional

from transformer.tasks import Metric


class RunClock:
    """Seconds of this run, carried across resumes by the checkpoint."""

    def __init__(self):
        self.before, self.started = 0.0, None

    def start(self) -> None:
        self.started = time.time()

    def seconds(self) -> float:
        return self.before + (time.time() - self.started if self.started is not None else 0.0)

    def state_dict(self) -> dict:
        return {"elapsed_s": self.seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.before = float(state.get("elapsed_s", 0.0))


class TimeToQuality:
    """{"val_bleu>=30": minutes, ...}: the first validation at which each declared level was reached."""

    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = [m for m in metrics if m.levels]
        self.reached: Dict[str, float] = {}

    @staticmethod
    def key(metric: Metric, level: float) -> str:
        return f"minutes_to_{metric.name}_{level:g}"

    def update(self, values: Dict[str, float], minutes: float) -> Dict[str, float]:
        """Records the levels `values` reach for the first time; returns them, to be logged with the scores."""
        new = {}
        for m in self.metrics:
            score: Optional[float] = values.get(m.name)
            if score is None:
                continue
            for level in m.levels:
                done = score >= level if m.higher_is_better else score <= level
                if done and self.key(m, level) not in self.reached:
                    new[self.key(m, level)] = minutes
        self.reached.update(new)
        return new

    def summary(self) -> str:
        return ", ".join(f"{k[len('minutes_to_'):]} after {v:g} min" for k, v in self.reached.items()) or "none"

    def state_dict(self) -> dict:
        return dict(self.reached)

    def load_state_dict(self, state: dict) -> None:
        self.reached = dict(state)
