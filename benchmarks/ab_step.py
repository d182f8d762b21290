"""Two configs' training steps alternated in one process on the same batches: a speed change of a few per cent
measured on a noisy host. Prints, asserts nothing.

    python benchmarks/ab_step.py experiment=multi30k data.root=DIR trainer.precision=bf16 \
        --b trainer.bf16_residual=true [--a ...] [--steps 40] [--warmup 3]

Separate `transformer-bench` runs a minute apart differ by 10-30 % on a shared 2-core machine
(docs/benchmarks/measuring.md), more than most switches change. Here one Trainer is built for the shared
overrides plus `--a`, one for the shared overrides plus `--b` (same seed, so the same initial weights where the
models agree), and each batch of A's stream is stepped by both, in the order A B B A, B A A B, ...: a slow spell
of the host lands on both sides, and each pair of steps did the same work. Printed: the median step of each
side, and the median and quartiles of the per-batch ratio B/A (< 1: B faster).
"""
import argparse
import sys
import time
from pathlib import Path
from statistics import median, quantiles

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.cli import compose_cfg  # noqa: E402
from transformer import dist  # noqa: E402
from transformer.training.loop.hotpath import LaggedFlag, TrainWindow  # noqa: E402
from transformer.training.tools.bench import build, endless_batches  # noqa: E402


def timed_step(trainer, micro, window, flag) -> float:
    t0 = time.perf_counter()
    trainer._train_step(micro, window, flag)
    return time.perf_counter() - t0


def order(i: int) -> str:
    """The sides' order at batch i: ABBA BAAB, repeated, so neither side always runs first."""
    return "ABBABAAB"[2 * (i % 4):2 * (i % 4) + 2]


def alternate(trainers: dict, batches, steps: int, warmup: int) -> dict:
    """Seconds per step of each side over `steps` batches after `warmup` untimed ones, same batches both sides."""
    times = {"A": [], "B": []}
    state = {side: (TrainWindow(), LaggedFlag()) for side in trainers}
    for i in range(warmup + steps):
        micro = [next(batches) for _ in range(trainers["A"].accumulate)]
        for side in order(i):
            dt = timed_step(trainers[side], micro, *state[side])
            if i >= warmup:
                times[side].append(dt)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["experiment=multi30k"])
    p.add_argument("--a", nargs="*", default=[], help="overrides of side A only")
    p.add_argument("--b", nargs="*", default=[], help="overrides of side B only")
    p.add_argument("--steps", type=int, default=40, help="timed batches (each stepped by both sides)")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    cfgs = {side: compose_cfg(*args.overrides, *extra, "trainer.accelerator=cpu", "trainer.progress=false")
            for side, extra in (("A", args.a), ("B", args.b))}
    env = dist.init(0, 0, 1, "cpu", cfgs["A"].trainer.timeout_s)
    try:
        trainers = {side: build(cfg, env) for side, cfg in cfgs.items()}
        if trainers["A"].accumulate != trainers["B"].accumulate:
            raise SystemExit("error: --a and --b must keep trainer.accumulate equal (the same batches per step)")
        times = alternate(trainers, endless_batches(trainers["A"].data), args.steps, args.warmup)
        for t in trainers.values():
            t.close()
    finally:
        dist.close()
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    q1, _, q3 = quantiles(ratios, n=4)
    print(f"{' '.join(args.overrides)}; A: {' '.join(args.a) or '(as given)'}; B: {' '.join(args.b) or '(as given)'}")
    print(f"{args.steps} batches, each stepped by both: A {1e3 * median(times['A']):.1f} ms, "
          f"B {1e3 * median(times['B']):.1f} ms a step (medians)")
    print(f"B/A per batch: median {median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
