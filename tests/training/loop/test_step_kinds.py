"""The step as a strategy (transformer/training/loop/step.py): the kind of step chosen once, its phase marks a
hook that does nothing unless transformer-bench times them."""
from tests.helpers.composed import small_trainer
from tests.helpers.models import one_thread  # noqa: F401  (autouse)
from tests.training.speed.test_graphs import FP32, graph_safe_trainer, ragged_steps, run
from transformer.training.loop.hotpath import NO_MARKS
from transformer.training.loop.step import EagerStep, GraphedStep


class Marks:
    def __init__(self):
        self.seen = []

    def start(self):
        self.seen.append("start")

    def mark(self, phase):
        self.seen.append(phase)


PHASES = ["start", "forward_backward", "communication", "optimizer"]


def test_the_default_step_is_eager_and_its_marks_do_nothing(tmp_path):
    t = small_trainer(tmp_path, *FP32)
    assert type(t.stepper) is EagerStep and t.graphs is None and t.stepper.marks is NO_MARKS
    t.stepper.marks = marks = Marks()
    run(t, ragged_steps(2, 2))
    assert marks.seen == PHASES * 2


def test_cuda_graphs_choose_the_graphed_step_with_the_same_marks(tmp_path):
    t = graph_safe_trainer(tmp_path, "trainer.accumulate=2")
    assert type(t.stepper) is GraphedStep and t.graphs is t.stepper.graphs
    t.stepper.marks = marks = Marks()
    run(t, ragged_steps(2, 2))
    assert marks.seen == PHASES * 2
