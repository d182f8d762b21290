"""The step's matrix products alone: how close to the measured peak an eager CPU step could come. Prints,
asserts nothing.

    python benchmarks/bench_products.py experiment=multi30k data.root=DIR trainer.precision=bf16
    python benchmarks/bench_products.py experiment=multi30k data.root=DIR trainer.precision=fp32 --steps 4

First `transformer-bench`'s own measurement of the config (its step time, MFU and the `torch.mm` peak probed
around the timed steps, bench.* overrides apply), then `--steps` more steps (the stream's first batches again)
with every product the step dispatches recorded, forward and backward: aten's mm, addmm, bmm and baddbmm with
their shapes, strides and dtypes, and the fused attention kernels (scaled_dot_product_*, whose products run inside
them). Each distinct call is then replayed alone on random tensors of the same layout, the best of repeated calls
as the peak probe takes it, so the sum is an optimistic time of the step's products with everything around them
free.

The last line is the ceiling: the recorded steps' useful FLOPs (real tokens, transformer/model/flops.py) over
that time, as a share of the peak. An eager step whose products alone stay under a target cannot reach it,
whatever its other work costs; the table says which calls run far below the peak, and `contig.` what the same
product reaches with its operands copied into row-major order first (the copy not counted).
"""
import argparse
import collections
import itertools
import operator
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.helpers.cli import compose_cfg  # noqa: E402
from transformer import dist  # noqa: E402
from transformer.training.loop.hotpath import LaggedFlag  # noqa: E402
from transformer.training.reporting.logs import Progress  # noqa: E402
from transformer.training.tools import bench  # noqa: E402
from transformer.training.tools.peak import best_call_seconds  # noqa: E402

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class Meta(tuple):
    """A recorded tensor argument: (shape, stride, dtype)."""


def is_product(func) -> bool:
    return func in GEMMS or "scaled_dot_product" in func.__name__


def _freeze(a):
    """An argument in hashable form: a tensor as its Meta, a list as a tuple."""
    if isinstance(a, torch.Tensor):
        return Meta((tuple(a.shape), a.stride(), a.dtype))
    return tuple(_freeze(v) for v in a) if isinstance(a, (list, tuple)) else a


def _thaw(a, contiguous: bool):
    """A random tensor in the recorded layout (row-major with `contiguous`) for a Meta; lists back as lists."""
    if isinstance(a, Meta):
        shape, stride, dtype = a
        if contiguous:
            stride = _row_major(shape)
        # the storage filled, then viewed: a broadcast operand (stride 0) has fewer elements than positions
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
        base = torch.empty(size, dtype=dtype)
        base = base.normal_() if dtype.is_floating_point else base.fill_(dtype == torch.bool)
        return base.as_strided(shape, stride)
    return [_thaw(v, contiguous) for v in a] if isinstance(a, tuple) else a


class ProductLog(TorchDispatchMode):
    """Counts every product call by (op, frozen args, frozen kwargs): `calls`."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_product(func):
            frozen = (tuple(_freeze(a) for a in args), tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())))
            self.calls[(func, frozen)] += 1
        return func(*args, **kwargs)


def best_seconds(func, frozen, contiguous: bool = False, seconds: float = 0.05) -> float:
    args = [_thaw(a, contiguous) for a in frozen[0]]
    kwargs = {k: _thaw(v, contiguous) for k, v in frozen[1]}
    return best_call_seconds(lambda: func(*args, **kwargs), seconds)


def gemm_flops(func, frozen) -> int:
    """2·m·k·n (times the batch for bmm and baddbmm) of a call of the mm family."""
    args = frozen[0]
    a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
    (*batch, m, k), n = a[0], b[0][-1]
    return 2 * m * k * n * (batch[0] if batch else 1)


def describe(func, frozen) -> str:
    metas = [a for a in frozen[0] if isinstance(a, Meta)]
    layout = " ".join("x".join(map(str, s)) + ("" if list(st) == _row_major(s) else "(T)") for s, st, _ in metas[:3])
    return f"{func.__name__.split('.')[0]:52.52s} {layout}"


def _row_major(shape) -> list:
    """The strides of a row-major (contiguous) tensor of `shape`."""
    return [] if not shape else list(itertools.accumulate(reversed(shape[1:]), operator.mul, initial=1))[::-1]


class Row(NamedTuple):
    """One distinct product call: its replayed time, alone and (mm family) with row-major operands."""
    func: object
    frozen: tuple
    calls: float  # per step
    seconds: float  # one call, replayed in the recorded layout
    contiguous: Optional[float]  # one call with row-major operands; None for the attention kernels

    @property
    def per_step(self) -> float:
        return self.calls * self.seconds


def record_products(trainer, steps: int):
    """{(op, frozen args): calls} over `steps` more steps (the stream's first batches again), and their useful
    FLOPs per step."""
    totals, log = bench.Totals(trainer.model.args, trainer.pad_multiple, bench.shape_of(trainer)), ProductLog()
    batches = bench.endless_batches(trainer.data)
    with log:
        bench.run_steps(trainer, batches, steps, Progress(None, 0, False), totals, LaggedFlag())
    return log.calls, totals.tally().flops_real / steps


def replay(calls, steps: int) -> List[Row]:
    rows = [Row(func, frozen, n / steps, best_seconds(func, frozen),
                best_seconds(func, frozen, contiguous=True) if func in GEMMS else None)
            for (func, frozen), n in calls.items()]
    return sorted(rows, key=lambda r: r.per_step, reverse=True)


def report(record: dict, rows: List[Row], useful: float, top: int) -> None:
    peak = record["peak_tflops"] * 1e12
    source = ("probes " + " / ".join(f"{x * 1e3:.0f}" for x in record["peak_probes"]) if record["peak_probes"]
              else record["peak_source"])
    print(f"bench: {record['step_ms']:.1f} ms a step, MFU {100 * record['mfu']:.1f}% of "
          f"{record['peak_tflops'] * 1e3:.0f} GFLOP/s ({source})")
    print(f"{'ms/step':>8} {'calls':>6} {'GFLOP/s':>8} {'% peak':>7} {'contig.':>8}  op and operand layouts "
          "((T): not row-major)")
    for r in rows[:top]:
        if r.contiguous is not None:
            f = gemm_flops(r.func, r.frozen)
            rate = f"{f / r.seconds / 1e9:8.0f} {100 * f / r.seconds / peak:6.1f}% {f / r.contiguous / 1e9:8.0f}"
        else:
            rate = f"{'':8} {'':7} {'':8}"
        print(f"{1e3 * r.per_step:8.2f} {r.calls:6.1f} {rate}  {describe(r.func, r.frozen)}")
    gemms = [r for r in rows if r.contiguous is not None]
    gemm_s = sum(r.per_step for r in gemms)
    total = sum(r.per_step for r in rows)
    gemm_rate = sum(gemm_flops(r.func, r.frozen) * r.calls for r in gemms) / gemm_s
    print(f"products alone: {1e3 * total:.1f} ms a step (mm family {1e3 * gemm_s:.1f}, attention kernels "
          f"{1e3 * (total - gemm_s):.1f}) of the bench's {record['step_ms']:.1f}; the mm family at "
          f"{gemm_rate / 1e9:.0f} GFLOP/s = {100 * gemm_rate / peak:.1f}% of the peak")
    print(f"ceiling: {useful / 1e9:.1f} useful GFLOP a step in {1e3 * total:.1f} ms = "
          f"{100 * useful / total / peak:.1f}% of the peak with everything else free "
          f"(the bench's MFU: {100 * record['mfu']:.1f}%)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["experiment=multi30k"])
    p.add_argument("--steps", type=int, default=3, help="recorded steps")
    p.add_argument("--top", type=int, default=15, help="product calls listed, by time")
    args = p.parse_args(argv)
    cfg = compose_cfg("bench.profile=false", "bench.repeats=1", *args.overrides, "trainer.accelerator=cpu")
    env = dist.init(0, 0, 1, "cpu", cfg.trainer.timeout_s)
    try:
        trainer = bench.build(cfg, env)
        record = bench.summarise(trainer, cfg, bench.measure(trainer, cfg.bench))
        calls, useful = record_products(trainer, args.steps)
        trainer.close()
    finally:
        dist.close()
    print(f"{' '.join(args.overrides)}: {record['compute']}, torch {torch.__version__}, {record['threads']} threads, "
          f"commit {record['commit']}, {record['date']}")
    report(record, replay(calls, args.steps), useful, args.top)


if __name__ == "__main__":
    main()
