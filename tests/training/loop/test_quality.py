"""Time to quality: the run clock survives resumes, each level is recorded once at its first validation,
and the figure draws scores against minutes."""
import json

import matplotlib.pyplot as plt

from transformer.tasks import Metric
from transformer.training.loop.quality import RunClock, TimeToQuality
from transformer.training.reporting.plots import read_metrics, time_figure

BLEU = Metric("val_bleu", higher_is_better=True, levels=(30.0, 35.0))
LOSS = Metric("val_loss", higher_is_better=False, levels=(2.0,))


def test_levels_are_recorded_once_at_their_first_validation():
    q = TimeToQuality([BLEU, LOSS, Metric("val_chrf", True)])
    assert q.update({"val_bleu": 29.0, "val_loss": 2.5}, 5.0) == {}
    assert q.update({"val_bleu": 31.0, "val_loss": 2.5}, 9.0) == {"minutes_to_val_bleu_30": 9.0}
    assert q.update({"val_bleu": 36.0, "val_loss": 1.9}, 12.5) == {"minutes_to_val_bleu_35": 12.5,
                                                                     "minutes_to_val_loss_2": 12.5}
    assert q.update({"val_bleu": 40.0, "val_loss": 1.0}, 20.0) == {}  # reached already
    resumed = TimeToQuality([BLEU, LOSS])
    resumed.load_state_dict(q.state_dict())
    assert resumed.update({"val_bleu": 37.0}, 30.0) == {} and "val_bleu_30 after 9 min" in resumed.summary()


def test_run_clock_carries_over_a_resume():
    clock = RunClock()
    clock.load_state_dict({"elapsed_s": 600.0})
    clock.start()
    assert 600.0 <= clock.seconds() < 610.0
    assert RunClock().seconds() == 0.0
    assert RunClock().state_dict() == {"elapsed_s": 0.0, "paused_s": {"validation": 0.0, "checkpoints": 0.0}}


def test_run_clock_carries_its_pauses_over_a_resume():
    """Validation and checkpoint seconds add up across resumes; a checkpoint written before they were kept
    loads with none."""
    clock = RunClock()
    clock.add_pause("validation", 90.0)
    clock.add_pause("checkpoints", 6.0)
    resumed = RunClock()
    resumed.load_state_dict(clock.state_dict())
    resumed.add_pause("validation", 30.0)
    assert resumed.paused == {"validation": 120.0, "checkpoints": 6.0}
    assert resumed.split() == "validation 2.0 min, checkpoints 0.1 min"
    old = RunClock()
    old.load_state_dict({"elapsed_s": 600.0})
    assert old.paused == {"validation": 0.0, "checkpoints": 0.0}


def test_time_figure_plots_scores_against_minutes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"split": "valid", "step": s, "val_bleu": b, "train_minutes": m} for s, b, m in
            ((100, 20.0, 4.0), (200, 31.0, 8.5), (300, 36.0, 13.0))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = time_figure(read_metrics(path))
    xs, ys = fig.axes[0].lines[0].get_data()
    assert list(xs) == [4.0, 8.5, 13.0] and list(ys) == [20.0, 31.0, 36.0]
    assert fig.axes[0].get_xlabel() == "wall minutes"
    plt.close(fig)
    assert time_figure(read_metrics(path).__class__()) is None  # no records, no figure
