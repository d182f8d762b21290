"""Static batch shapes (trainer.static_shapes) on a real training split: prints, asserts nothing.

    python benchmarks/bench_shapes.py [experiment=multi30k] [data.root=DIR] [--budgets 512,1024,2048,4096,16384]
    python benchmarks/bench_shapes.py --synthetic 200000 --budgets 3300,16384   # transformer-bench's lengths
    python benchmarks/bench_shapes.py experiment=multi30k data.root=DIR --steps 4,8,16   # trainer.shape_steps
    python benchmarks/bench_shapes.py experiment=multi30k data.root=DIR --packed   # + packed token budgets

For each token budget, one epoch as the sampler plans it, without and with static shapes (a column pair per
ladder of `--steps` lengths an octave): batches, distinct (rows, source, target) shapes the model would see, and
the share of the computed source+target positions that is padding (to each batch's longest sentence; with static
shapes, to the static shape's rows and lengths). `--packed` adds a last column: packed token budgets
(trainer.static_shapes with trainer.unpadded_attention, transformer/experimental/packed.py), whose waste is their
filler.
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from tests.helpers.cli import compose_cfg  # noqa: E402
from transformer.data import build_data  # noqa: E402
from transformer.data.sampler import TokenBatchSampler  # noqa: E402
from transformer.data.shapes import STEPS, static_shape  # noqa: E402
from transformer.data.synthetic import synthetic_lengths  # noqa: E402
from transformer.dist import DistEnv  # noqa: E402
from transformer.experimental import packed  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["experiment=multi30k"])
    p.add_argument("--budgets", default="512,1024,2048,4096,16384")
    p.add_argument("--steps", default=str(STEPS), help="trainer.shape_steps values, comma-separated")
    p.add_argument("--packed", action="store_true", help="a column for packed token budgets (at the first --steps)")
    p.add_argument("--synthetic", type=int, metavar="N",
                   help="N pairs of transformer-bench's synthetic lengths (bench.length_mean, ...) instead of data")
    args = p.parse_args(argv)
    cfg = compose_cfg(*args.overrides, "trainer.accelerator=cpu")
    if args.synthetic:
        src, tgt = synthetic_lengths(args.synthetic, cfg.bench, np.random.default_rng(cfg.seed))
        name = f"synthetic lengths (mean {cfg.bench.length_mean}, std {cfg.bench.length_std})"
    else:
        data = build_data(cfg, DistEnv(), None, None)
        src, tgt = data.train.src_sizes, data.train.tgt_sizes
        name = " ".join(args.overrides)
    real = int(src.sum() + tgt.sum())
    print(f"{name}: {len(src)} pairs, {real} source+target tokens (specials included)")
    ladders = [int(x) for x in args.steps.split(",")]
    static = " / ".join([f"static {n}" for n in ladders] + (["packed"] if args.packed else []))
    print(f"| max_tokens | batches plain / {static} | distinct shapes plain / {static} | "
          f"padding share plain / {static} |")
    print("|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        row = []
        for steps in [None, *ladders]:
            batches = TokenBatchSampler(src, tgt, budget, cfg.data.max_sentences, seed=cfg.seed,
                                        static_shapes=steps is not None, shape_steps=steps or STEPS).epoch_batches(0)
            shapes = [static_shape(int(src[b].max()), int(tgt[b].max()), budget, cfg.data.max_sentences, steps)
                      if steps else (len(b), int(src[b].max()), int(tgt[b].max())) for b in batches]
            padded = sum(R * (S + T) for R, S, T in shapes)
            row.append((len(batches), len(set(shapes)), 1 - real / padded))
        if args.packed:
            batches = TokenBatchSampler(src, tgt, budget, cfg.data.max_sentences, seed=cfg.seed,
                                        packed=True).epoch_batches(0)
            widths = (int(src.max()), int(tgt.max()))
            layouts = [packed.layout(src[b], tgt[b], budget, ladders[0], widths) for b in batches]
            computed = sum(lay.N_s + lay.N_t for lay in layouts)
            row.append((len(batches), len({lay.shape for lay in layouts}), 1 - real / computed))
        print(f"| {budget:,} | {' / '.join(f'{b:,}' for b, _, _ in row)} | {' / '.join(str(n) for _, n, _ in row)} | "
              f"{' / '.join(f'{100 * w:.1f} %' for _, _, w in row)} |")


if __name__ == "__main__":
    main()
