"""Judge two choice rules on held-out halves of a validation set: choose on one half, score on the other.

    python benchmarks/split_halves.py --ref val.en.gz --grid short=lp1.0,lp1.2,lp1.4,lp1.6 \\
        --grid long=lp1.0,lp1.2,lp1.4,lp1.6,lp1.8,lp2.0 RUN_A RUN_B ...

Each RUN folder holds one subfolder per candidate (a label: a length penalty, a checkpoint, a beam), each with
the hypotheses of the whole validation set (`transformer-evaluate ... --split val --out-dir RUN/LABEL` writes
RUN/LABEL/val.hyp). A grid is a rule "the candidate of this list with the highest BLEU on the choosing half".
For every run, split and direction the first grid's and the second grid's choices are scored on the other half;
the summary is the second minus the first: mean, cases won, lost and tied, and per run.

Splits are random halves (seeded shuffles) by default. `--split parity` uses even and odd lines, which is
biased on Multi30k: its files mostly alternate short and long sentences, so each half prefers the length
penalty that fits its own lengths (docs/multi30k.md "Scoring only the target's types on the recipe").
"""
import argparse
import json
import random
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import sacrebleu

from transformer.data.corpus import read_lines


def parse_grid(text: str) -> Tuple[str, List[str]]:
    name, sep, labels = text.partition("=")
    if not sep or not name or not labels:
        raise ValueError(f"--grid {text!r}: expected NAME=LABEL,LABEL,...")
    return name, labels.split(",")


def halves(n: int, split: str, n_splits: int) -> List[Tuple[List[int], List[int]]]:
    if split == "parity":
        return [(list(range(0, n, 2)), list(range(1, n, 2)))]
    out = []
    for seed in range(n_splits):
        idx = list(range(n))
        random.Random(seed).shuffle(idx)
        out.append((sorted(idx[: n // 2]), sorted(idx[n // 2:])))
    return out


def bleu(hyps: Sequence[str], refs: Sequence[str], rows: Sequence[int]) -> float:
    return sacrebleu.corpus_bleu([hyps[i] for i in rows], [[refs[i] for i in rows]]).score


def judge(refs: List[str], runs: Dict[str, Dict[str, List[str]]], grids: List[Tuple[str, List[str]]],
          split: str = "random", n_splits: int = 10) -> dict:
    """Held-out BLEU of the second grid's choice minus the first's, over runs × splits × both directions."""
    (_, first), (_, second) = grids
    diffs: Dict[str, List[float]] = {}
    for run, hyps in runs.items():
        for a, b in halves(len(refs), split, n_splits):
            for choose, score in ((a, b), (b, a)):
                on = {label: bleu(h, refs, choose) for label, h in hyps.items()}
                held = [bleu(hyps[max(g, key=on.__getitem__)], refs, score) for g in (first, second)]
                diffs.setdefault(run, []).append(held[1] - held[0])
    every = [d for ds in diffs.values() for d in ds]
    return {"cases": len(every), "mean_diff": round(sum(every) / len(every), 3),
            "won": sum(d > 0.005 for d in every), "lost": sum(d < -0.005 for d in every),
            "tied": sum(abs(d) <= 0.005 for d in every),
            "per_run": {run: round(sum(ds) / len(ds), 3) for run, ds in diffs.items()},
            "grids": [g[0] for g in grids], "split": split}


def load_runs(folders: Sequence[Path], labels: Sequence[str], name: str,
              n_refs: int) -> Dict[str, Dict[str, List[str]]]:
    runs = {}
    for folder in folders:
        hyps = {}
        for label in labels:
            path = folder / label / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no hypotheses for candidate {label!r}")
            hyps[label] = read_lines(path)
            if len(hyps[label]) != n_refs:
                raise ValueError(f"{path}: {len(hyps[label])} lines, the references have {n_refs}")
        runs[str(folder)] = hyps
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders holding LABEL/NAME hypothesis files")
    p.add_argument("--ref", required=True, type=Path, help="references, one a line (.gz read as gzip)")
    p.add_argument("--grid", action="append", required=True, help="NAME=LABEL,LABEL,... (exactly two)")
    p.add_argument("--name", default="val.hyp", help="hypothesis file name in each LABEL folder")
    p.add_argument("--split", choices=("random", "parity"), default="random")
    p.add_argument("--splits", type=int, default=10, help="random halves (seeds 0..N-1)")
    args = p.parse_args(argv)
    try:
        if args.splits < 1:
            raise ValueError(f"--splits {args.splits}: must be at least 1")
        if len(args.grid) != 2:
            raise ValueError(f"--grid given {len(args.grid)} times: exactly two rules are compared")
        grids = [parse_grid(g) for g in args.grid]
        labels = sorted({label for _, g in grids for label in g})
        refs = read_lines(args.ref)
        runs = load_runs(args.runs, labels, args.name, len(refs))
    except (OSError, ValueError) as e:
        print(f"split_halves: {e}", file=sys.stderr)
        return 2
    print(json.dumps(judge(refs, runs, grids, args.split, args.splits)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
