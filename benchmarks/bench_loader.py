"""What a training step pays the data loader on the host: the time the main process waits in `next()` for a
batch from the loader workers, with a sleep standing in for the step. Small batches on a GPU (experiment=multi30k:
2,048 tokens, steps of a few milliseconds with CUDA graphs) can spend a tenth of a step here. Prints measured
numbers, asserts nothing.

    python benchmarks/bench_loader.py [--workers 2] [--step-ms 10] [--epochs 3] [--static] [override ...]

Overrides are transformer-train's (default: experiment=multi30k with transformer-bench's synthetic sentences of
Multi30k's lengths); --static pads batches to the static-shape ladder as trainer.cuda_graphs does.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.cli import compose_cfg  # noqa: E402 (the composition benchmarks share with the tests)

DEFAULTS = ["experiment=multi30k", "bench.synthetic=true", "bench.vocab_size=8000", "bench.length_mean=14",
            "bench.length_std=5"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (2: the GPU default)")
    p.add_argument("--step-ms", type=float, default=10.0, help="the step the loader must keep up with")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs, after one untimed")
    p.add_argument("--static", action="store_true", help="static-shape batches (trainer.cuda_graphs)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from transformer.data.synthetic import SyntheticData

    cfg = compose_cfg(*DEFAULTS, *args.overrides)
    data = SyntheticData(cfg, 0, 1, pin_memory=False, num_workers=args.workers)
    if args.static:
        data.use_static_shapes()
    waits, firsts, per_epoch, sentences = [], [], [], []
    for epoch in range(args.epochs + 1):
        epoch_waits = []
        batches = iter(data.train_loader(epoch))
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            epoch_waits.append(time.perf_counter() - t0)
            sentences.append(len(batch))
            time.sleep(args.step_ms / 1000)
        if epoch > 0:  # the first epoch starts the workers
            firsts.append(epoch_waits[0])
            waits += epoch_waits[1:]
            per_epoch.append((len(epoch_waits), sum(epoch_waits)))
    ms = sorted(1000 * w for w in waits)
    print(f"loader: {args.workers} workers, {'static' if args.static else 'token-bucketed'} batches, "
          f"{args.step_ms:g} ms steps, {args.epochs} epochs of {per_epoch[0][0]} batches "
          f"(median {statistics.median(sentences):g} sentences)")
    print(f"  next() within an epoch: median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms")
    print(f"  first batch of an epoch: median {1000 * statistics.median(firsts):.1f} ms")
    print(f"  waiting per epoch: {', '.join(f'{1000 * s:.0f} ms' for _, s in per_epoch)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
