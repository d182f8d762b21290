"""Checkpoint averaging (paper Section 6.1: "we used a single model obtained by averaging the last 5
checkpoints"), with fairseq's average_checkpoints semantics; `transformer-average` is its command.

Every parameter and buffer of the model state is averaged (accumulated in float64, stored in its own
dtype; integer tensors are floor-averaged); the result keeps `model_args`, the tokenizer and the config
of the newest input and drops the optimizer/scheduler/RNG state, so it is for translating, evaluating
or `trainer.init_from`, not for resuming. Inputs must share architecture and tokenizer.
"""
from pathlib import Path
from typing import List, Sequence

import torch

from transformer.checkpoint_files import FORMAT, STEP_FILE
from transformer.training.components.checkpoint import load_checkpoint, model_weights


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
        state = model_weights(ckpt)  # a run's weight average, where it kept one
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
