"""`transformer-average`: average the weights of several checkpoints (paper Section 6.1: "we used a single
model obtained by averaging the last 5 checkpoints"), with fairseq's average_checkpoints semantics.

    transformer-average outputs/run --last 5                     # -> outputs/run/checkpoints/average_last5.pt
    transformer-average a.pt b.pt c.pt --output averaged.pt

Every parameter and buffer of the model state is averaged (accumulated in float64, stored in its own
dtype; integer tensors are floor-averaged); the result keeps `model_args`, the tokenizer and the config
of the newest input and drops the optimizer/scheduler/RNG state, so it is for translating, evaluating
or `trainer.init_from`, not for resuming. Inputs must share architecture and tokenizer.
"""
import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from transformer.checkpoint import FORMAT, STEP_FILE, CheckpointError, atomic_save, load_checkpoint

PROG = "transformer-average"


class AverageError(ValueError):
    pass


def last_checkpoints(run_dir: Path, n: int) -> List[Path]:
    """The newest `n` step_<N>.pt files of RUN_DIR/checkpoints (or of RUN_DIR itself), oldest first."""
    run_dir = Path(run_dir)
    folder = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE.match(p.name)))
    if len(found) < n:
        raise AverageError(f"{folder}: {len(found)} step_*.pt checkpoints, fewer than --last {n}")
    return [p for _, p in found[-n:]]


def _describe_difference(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in diff[:4])


def average_checkpoints(paths: Sequence[Path]) -> dict:
    """One checkpoint dict whose model state is the mean of the inputs'."""
    if not paths:
        raise AverageError("no checkpoints to average")
    first, total, count = None, None, len(paths)
    for path in paths:
        ckpt = load_checkpoint(path)
        state = ckpt["model"]
        if first is None:
            first = ckpt
            total = {k: v.to(torch.float64) if v.is_floating_point() else v.to(torch.int64).clone()
                     for k, v in state.items()}
            dtypes = {k: v.dtype for k, v in state.items()}
            continue
        if ckpt["model_args"] != first["model_args"]:
            raise AverageError(f"{path} has a different architecture than {paths[0]} "
                               f"({_describe_difference(first['model_args'], ckpt['model_args'])})")
        if ckpt.get("tokenizer") != first.get("tokenizer"):
            raise AverageError(f"{path} has a different tokenizer/vocabulary than {paths[0]}")
        if set(state) != set(total):
            missing = sorted(set(total) ^ set(state))
            raise AverageError(f"{path} has different parameters than {paths[0]} (e.g. {missing[0]})")
        for k, v in state.items():
            if v.shape != total[k].shape:
                raise AverageError(f"{path}: {k} has shape {tuple(v.shape)}, {paths[0]} has {tuple(total[k].shape)}")
            total[k] += v.to(total[k].dtype)
    averaged = {}
    for k, v in total.items():
        v = v / count if v.is_floating_point() else torch.div(v, count, rounding_mode="floor")
        averaged[k] = v.to(dtypes[k])
    last = ckpt  # the newest input (inputs are given oldest first)
    steps = [int(m.group(1)) if (m := STEP_FILE.match(Path(p).name)) else None for p in paths]
    return {"format": FORMAT, "model_args": last["model_args"], "model": averaged, "tokenizer": last.get("tokenizer"),
            "config": last.get("config"),
            "trainer": {**{k: v for k, v in (last.get("trainer") or {}).items() if k in ("step", "epoch")},
                        "averaged_from": [str(Path(p).resolve()) for p in paths], "averaged_steps": steps}}


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
    try:
        output, paths = run(args)
    except (AverageError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"{PROG}: averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
