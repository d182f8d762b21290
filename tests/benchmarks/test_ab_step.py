"""benchmarks/ab_step.py: two configs' steps alternated on the same batches."""
import re

from tests.helpers.benchmarks import load_benchmark

ab = load_benchmark("ab_step")
TINY = ["model=tiny", "model.N=1", "bench.synthetic=true", "bench.sentences=200", "bench.vocab_size=300",
        "bench.max_len=30", "data.max_tokens=400", "trainer.precision=fp32"]


def test_each_side_runs_first_half_the_time():
    orders = [ab.order(i) for i in range(8)]
    assert orders == ["AB", "BA", "BA", "AB"] * 2
    assert sum(o[0] == "A" for o in orders) == 4


def test_both_sides_step_every_batch(capsys):
    ab.main([*TINY, "--b", "model.dropout=0.0", "--steps", "4", "--warmup", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("A: (as given); B: model.dropout=0.0")
    assert re.fullmatch(r"4 batches, each stepped by both: A [\d.]+ ms, B [\d.]+ ms a step \(medians\)", out[1])
    assert re.fullmatch(r"B/A per batch: median [\d.]+ \(quartiles [\d.]+-[\d.]+\)", out[2])


def test_the_sides_see_the_same_batches():
    seen = {"A": [], "B": []}

    class Side:
        accumulate = 1

        def __init__(self, name):
            self.name = name

        def _train_step(self, micro, window, flag):
            seen[self.name].append(micro[0])

    times = ab.alternate({"A": Side("A"), "B": Side("B")}, iter(range(10)), steps=5, warmup=2)
    assert seen["A"] == seen["B"] == list(range(7))
    assert len(times["A"]) == len(times["B"]) == 5
