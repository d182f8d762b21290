"""The host's own time a training step, on a CPU: `transformer-bench`'s loop over the CUDA-graph step
(trainer.cuda_graphs) with the graphs' bodies (forward, loss, backward; the update) replaced by nothing, so what
is left is what the host does every step besides replaying them: receiving the batch from the loader workers,
padding it to its static shape, copying it into the graph's inputs, the non-finite flag and the statistics, the
schedule, the step's bookkeeping. On a GPU that work decides the pace of steps whose kernels are shorter
(Multi30k's batches: docs/benchmarks/the-step.md, "The host"). The model keeps its layers (module and parameter
counts are host work) at a negligible width (the flag's gradient norms are computed for real here). Prints measured
numbers, asserts nothing.

    python benchmarks/bench_host.py [--steps 300] [--workers 2] [--profile 20] [override ...]

Overrides are transformer-train's (default: experiment=multi30k with transformer-bench's synthetic sentences of
Multi30k's lengths; `model.N=6 model.N_dec=6` for base's 6 + 6 layers: the recipe fixes its own depth, which
`model=base` alone does not change).
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.cli import compose_cfg  # noqa: E402 (the composition benchmarks share with the tests)

DEFAULTS = ["experiment=multi30k", "bench.synthetic=true", "bench.vocab_size=8000", "bench.length_mean=14",
            "bench.length_std=5", "trainer.precision=fp32", "trainer.progress=false"]
NARROW = ["model.d_model=16", "model.d_ff=32"]  # the layers stay; their products cost next to nothing


def build(overrides, workers: int):
    """A trainer whose step is the CUDA-graph one, run without capture on this CPU (as
    tests/training/speed/test_graphs.py
    builds it), its graph bodies stubbed out."""
    import torch

    from transformer import dist
    from transformer.data.synthetic import SyntheticData
    from transformer.tasks import build_task
    from transformer.training.distributed.parallelize import build_model, parallelize
    from transformer.training.loop.trainer import Trainer
    from transformer.training.speed import graphs

    common = [*DEFAULTS, *NARROW, f"data.num_workers={workers}", *overrides]
    cfg = compose_cfg(*common, "trainer.cuda_graphs=true")
    env = dist.init(0, 0, 1, "cpu", 60)
    data = SyntheticData(cfg, 0, 1, pin_memory=False, num_workers=workers)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data)
    # parallelize refuses cuda_graphs on a CPU: the model is wrapped as for static shapes, as cuda_graphs wraps it
    trainer = Trainer(cfg, env, parallelize(model, compose_cfg(*common, "trainer.static_shapes=true"), env), data,
                      build_task(cfg), None)
    graphs.GraphStep._forward_backward = lambda self, *tensors, layout=None: None  # a replay's host cost: ~none
    graphs.GraphStep._update = lambda self: None
    return trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps, after 10 untimed")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (2: the GPU default)")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="also print the K functions with the most "
                   "own time (cProfile, which slows the loop)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from transformer.training.reporting.logs import Progress
    from transformer.training.tools import bench

    trainer = build(args.overrides, args.workers)
    batches = bench.endless_batches(trainer.data)
    quiet = Progress(None, 0, False)
    bench.run_steps(trainer, batches, 10, quiet)
    totals = bench.Totals(trainer.model.args, trainer.pad_multiple, bench.shape_of(trainer))
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    bench.run_steps(trainer, batches, args.steps, quiet, totals)
    if prof:
        prof.disable()
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    totals.tally()
    data_ms = 1e3 * totals.data_s / args.steps
    a = trainer.model.args
    print(f"host: {a.N} + {a.N_dec} layers, {sum(1 for _ in trainer.model.modules())} modules, "
          f"{sum(1 for _ in trainer.model.parameters())} parameter tensors; {args.workers} loader workers, "
          f"{len(totals.shapes)} static shapes; {args.steps} steps" + (" (profiled)" if prof else ""))
    print(f"  {ms:.3f} ms a step: waiting for data {data_ms:.3f}, the rest {ms - data_ms:.3f}")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
