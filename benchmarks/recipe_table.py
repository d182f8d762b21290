"""The recipe search's table: one Markdown row per run directory, from what the runs wrote themselves.

    python benchmarks/recipe_table.py multirun/DATE/TIME [more run or sweep folders ...]

A folder is a run directory (it holds metrics.jsonl) or a sweep folder whose subfolders are run
directories (Hydra's multirun layout). Each row: the run's command-line overrides (.hydra/overrides.yaml),
its best validation score and the step and minutes at which it was reached, the last validation, the wall
minutes (training and validation), and the minutes to each level the task declares (minutes_to_*). Only
validation is read: test scores are never part of a search.
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import yaml

# Overrides every row of a search shares (where the data is) say nothing about the recipe.
_HIDDEN = ("data.root=", "hydra.", "trainer.progress=")


def run_dirs(folder: Path) -> Iterator[Path]:
    if (folder / "metrics.jsonl").is_file():
        yield folder
        return
    subs = sorted((p for p in folder.iterdir() if (p / "metrics.jsonl").is_file()),
                  key=lambda p: (len(p.name), p.name))  # Hydra numbers jobs 0, 1, ..., 10
    if not subs:
        raise FileNotFoundError(f"{folder}: no metrics.jsonl in it or in its subfolders")
    yield from subs


def overrides(run: Path) -> str:
    path = run / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(path.read_text()) if path.is_file() else []
    return " ".join(o for o in items or [] if not o.startswith(_HIDDEN)) or "(defaults)"


def row(run: Path, metric: str) -> Optional[Dict[str, object]]:
    valid: List[dict] = []
    with open(run / "metrics.jsonl", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{run / 'metrics.jsonl'}, line {n}: not JSON") from None
            if record.get("split") == "valid" and metric in record:
                valid.append(record)
    if not valid:
        return None
    best = max(valid, key=lambda r: r[metric])
    levels = {}
    for record in valid:
        for key, minutes in record.items():
            if key.startswith(f"minutes_to_{metric}_"):
                levels[key[len(f"minutes_to_{metric}_"):]] = minutes
    return {"overrides": overrides(run), "best": best[metric], "best_step": best["step"],
            "best_minutes": best.get("train_minutes"), "last": valid[-1][metric], "steps": valid[-1]["step"],
            "minutes": valid[-1].get("train_minutes"), "levels": levels}


def table(rows: List[Dict[str, object]], metric: str) -> str:
    levels = sorted({lv for r in rows for lv in r["levels"]}, key=float)
    head = ["overrides", f"best {metric}", "at step", "at min", f"last {metric}", "steps", "min",
            *(f"min to {lv}" for lv in levels)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: -r["best"]):
        cells = [f"`{r['overrides']}`", f"{r['best']:.2f}", r["best_step"], r["best_minutes"], f"{r['last']:.2f}",
                 r["steps"], r["minutes"], *(r["levels"].get(lv, "—") for lv in levels)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="run directories or sweep folders")
    p.add_argument("--metric", default="val_bleu", help="validation score to rank by (default val_bleu)")
    args = p.parse_args(argv)
    rows = []
    try:
        for folder in args.folders:
            for run in run_dirs(folder):
                r = row(run, args.metric)
                if r is None:
                    print(f"{run}: no validation with {args.metric} yet: skipped", file=sys.stderr)
                else:
                    rows.append(r)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: no run with a validation {args.metric}", file=sys.stderr)
        return 2
    print(table(rows, args.metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
