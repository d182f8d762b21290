"""Time to quality: the run's wall clock (training and validation, summed over resumes) and the minutes at
which each validation score first reached the levels its task declares (BLEU 30, 35, 38, 40; ...), so
recipes are compared by the time they take, not only by where they end."""
import time
from typing import Dict, Iterable, Optional

from transformer.tasks import Metric


class RunClock:
    """Seconds of this run, carried across resumes by the checkpoint, and how many of them went to validation
    and to checkpoint writes between training steps (`paused`), for the run's summary line."""

    PAUSES = ("validation", "checkpoints")

    def __init__(self):
        self.before, self.started = 0.0, None
        self.paused: Dict[str, float] = dict.fromkeys(self.PAUSES, 0.0)

    def add_pause(self, kind: str, seconds: float) -> None:
        self.paused[kind] += seconds

    def split(self) -> str:
        """"validation 0.4 min, checkpoints 0.1 min": what the run's minutes went to besides its steps."""
        return ", ".join(f"{kind} {seconds / 60:.1f} min" for kind, seconds in self.paused.items())

    def start(self) -> None:
        self.started = time.time()

    def seconds(self) -> float:
        return self.before + (time.time() - self.started if self.started is not None else 0.0)

    def state_dict(self) -> dict:
        return {"elapsed_s": self.seconds(), "paused_s": dict(self.paused)}

    def load_state_dict(self, state: dict) -> None:
        self.before = float(state.get("elapsed_s", 0.0))
        for kind, seconds in state.get("paused_s", {}).items():  # absent from checkpoints of earlier versions
            if kind in self.paused:
                self.paused[kind] = float(seconds)


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
