"""`transformer-plot RUN_DIR`: PNG plots of a training run and of attention weights
(transformer/training/reporting/plots.py).

    transformer-plot outputs/run                                  # -> outputs/run/plots/*.png
    transformer-plot outputs/run --sentence "Ein Hund rennt ."    # + attention maps (best.pt or last.pt)
"""
import argparse
import sys
from itertools import chain
from pathlib import Path
from typing import List, Optional

from transformer.cli.common import UsageError, run_command
from transformer.config import eval_from_dict
from transformer.training.components.checkpoint import load_model
from transformer.training.reporting.plots import (
    attention_figures,
    close_figures,
    curve_figures,
    read_metrics,
    save_figures,
)

PROG = "transformer-plot"


def _find_checkpoint(run_dir: Path) -> Optional[Path]:
    for name in ("best.pt", "last.pt"):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    return None


def _run_config(run_dir: Path, ckpt: Optional[dict]) -> Optional[dict]:
    cfg = (ckpt or {}).get("config")
    if cfg is None and (run_dir / ".hydra" / "config.yaml").is_file():
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=False)
    return cfg


def run(args) -> List[Path]:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such run directory")
    out_dir = Path(args.out_dir) if args.out_dir else run_dir / "plots"
    metrics = run_dir / "metrics.jsonl"
    ckpt_path = Path(args.checkpoint) if args.checkpoint else _find_checkpoint(run_dir)
    model = tokenizer = ckpt = None
    if ckpt_path is not None and (args.sentence or args.checkpoint):
        model, tokenizer, ckpt = load_model(ckpt_path)
    cfg = _run_config(run_dir, ckpt)
    curves = curve_figures(read_metrics(metrics), cfg) if metrics.is_file() else {}
    if not curves and not args.sentence:
        raise UsageError(f"nothing to plot: {metrics} is missing or holds no curves, and no --sentence was given")
    figs = curves.items()
    if args.sentence:
        if model is None:
            close_figures(curves.values())
            raise UsageError(f"--sentence needs a checkpoint: none in {run_dir / 'checkpoints'}, give --checkpoint")
        ev = eval_from_dict((cfg or {}).get("eval"))
        figs = chain(figs, attention_figures(model, tokenizer, args.sentence, ev))
    return save_figures(figs, out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="PNG plots of a training run and of attention weights.")
    p.add_argument("run_dir", help="run directory (holds metrics.jsonl and checkpoints/)")
    p.add_argument("--checkpoint",
                   help="checkpoint for attention maps (default: RUN_DIR/checkpoints/best.pt, else last.pt)")
    p.add_argument("--sentence", help="source sentence whose attention maps are drawn")
    p.add_argument("--out-dir", help="where the PNG files go (default: RUN_DIR/plots)")
    args = p.parse_args(argv)

    def body() -> int:
        for path in run(args):
            print(path)
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
