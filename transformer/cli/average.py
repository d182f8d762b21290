"""`transformer-average`: average the weights of several checkpoints (transformer/training/components/averaging.py).

    transformer-average outputs/run --last 5                     # -> outputs/run/checkpoints/average_last5.pt
    transformer-average a.pt b.pt c.pt --output averaged.pt
"""
import argparse
import sys
from pathlib import Path
from typing import Optional

from transformer.cli.common import run_command
from transformer.training.components.averaging import AverageError, average_checkpoints, last_checkpoints
from transformer.training.components.checkpoint import atomic_save

PROG = "transformer-average"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Average the model weights of several checkpoints.")
    p.add_argument("inputs", nargs="+", help="a run directory (with --last N) or checkpoint files")
    p.add_argument("--last", type=int, default=None,
                   help="with a run directory: average its newest N step_*.pt checkpoints (default 5)")
    p.add_argument("--output", help="averaged checkpoint file (default with a run directory: "
                                    "RUN_DIR/checkpoints/average_lastN.pt)")
    return p


def run(args: argparse.Namespace):
    """(output path, input paths)."""
    inputs = [Path(p) for p in args.inputs]
    output: Optional[Path] = Path(args.output) if args.output else None
    if len(inputs) == 1 and inputs[0].is_dir():
        n = 5 if args.last is None else args.last
        if n < 1:
            raise AverageError(f"--last {n}: must be >= 1")
        paths = last_checkpoints(inputs[0], n)
        output = output or paths[0].parent / f"average_last{n}.pt"
    else:
        if args.last is not None:
            raise AverageError("--last goes with one run directory, not with checkpoint files")
        for p in inputs:
            if not p.is_file():
                raise AverageError(f"{p}: no such checkpoint file")
        if len(set(p.resolve() for p in inputs)) != len(inputs):
            raise AverageError("the same checkpoint is listed twice")
        if output is None:
            raise AverageError("--output FILE is required when averaging checkpoint files")
        paths = inputs
    if output.resolve() in {p.resolve() for p in paths}:
        raise AverageError(f"--output {output}: would overwrite one of the inputs")
    averaged = average_checkpoints(paths)
    atomic_save(averaged, output)
    return output, paths


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        output, paths = run(args)
        print(f"{PROG}: averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {output}")
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
