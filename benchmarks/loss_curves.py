"""Loss curves of model=tiny with and without each speed switch of the model: the same seed, initial weights,
batches and dropout draws (packed rows draw other masks), so a switch that keeps the mathematics keeps the curve.

    python benchmarks/loss_curves.py --steps 300 --variants fp32,bf16,bf16_residual,unpadded --out curves.json
    python benchmarks/loss_curves.py --device cuda --steps 1000 --variants bf16,fp8 --out fp8.json   # a GPU

The task is the copy task with sentences of varied lengths (3 to 16 symbols, so batches are padded), trained with
Adam and the Noam schedule of experiment=copy (factor 0.25, warmup 200), P_drop 0.1, label smoothing 0.1. Variants:
  fp32           the reference: no autocast, every switch off
  bf16           bf16 autocast (trainer.precision=bf16), switches off
  bf16_residual  bf16 autocast with trainer.bf16_residual=true
  unpadded       fp32 with trainer.unpadded_attention=true
  reference_loss fp32 with trainer.loss=reference (log_softmax and autograd) instead of the fused loss
  fp8            trainer.precision=fp8: the Linear layers' products in float8 under bf16 autocast (GPU only:
                 compute capability >= 8.9 and torchao; compare it with bf16 on the same --device)
A variant whose switch this version lacks, or that cannot run on --device, is reported as skipped. Printed for each
variant against the first: the mean and the largest relative gap between the two curves smoothed over --window
steps, the first step at which the raw losses differ by more than 1e-4, and the mean loss of the last --window
steps. The largest gap measures chaos more than arithmetic: once the model starts to learn the copy, rounding-level
differences shift the steep part of the curve by a few steps. The script runs on earlier versions of the package too
(fp32 and bf16): the stacked projections, which have no switch, are compared by running it once with each version on
PYTHONPATH and comparing the --out files with --against.
"""
import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.specials import BOS, EOS, PAD
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.components.optim import build_optimizer

SWITCHES = {  # variant -> (autocast, the ModelOptions field that turns its switch on, or None)
    "fp32": (False, None),
    "bf16": (True, None),
    "bf16_residual": (True, "bf16_residual"),
    "unpadded": (False, "unpadded_attention"),
    "reference_loss": (False, None),
    "fp8": (True, None),  # transformer/experimental/fp8.py converts the model
}
LOSS = {"reference_loss": {"impl": "reference"}}  # variant -> label_smoothed_cross_entropy's keyword arguments
VOCAB = 24


def copy_batch(g: torch.Generator, sentences: int, min_len: int, max_len: int):
    """(src (B, S), tgt_in (B, T), tgt_out (B, T)): the target copies the source, right-padded."""
    lengths = torch.randint(min_len, max_len + 1, (sentences,), generator=g)
    S = int(lengths.max())
    src = torch.randint(4, VOCAB, (sentences, S), generator=g)
    src[torch.arange(S)[None, :] >= lengths[:, None]] = PAD
    tgt_in = torch.cat([torch.full((sentences, 1), BOS), src], dim=1)
    tgt_out = torch.cat([src, torch.full((sentences, 1), PAD)], dim=1)
    tgt_out[torch.arange(sentences), lengths] = EOS
    return src, tgt_in, tgt_out


def train(variant: str, steps: int, seed: int, sentences: int = 32, dropout: float = 0.1,
          device: str = "cpu") -> Optional[List[float]]:
    """The per-step training loss (mean per target token) of model=tiny under `variant` on `device`; None where
    this version of the model lacks the variant's switch."""
    amp, switch = SWITCHES[variant]
    options = {}
    if switch is not None:
        try:  # a version of the model before ModelOptions, or without this switch, lacks the variant
            from transformer.model import ModelOptions
            options["options"] = ModelOptions(**{switch: True})
        except (ImportError, TypeError):
            return None
    torch.manual_seed(seed)
    model = Transformer.from_config(ModelConfig(N=2, d_model=128, d_ff=256, h=4, dropout=dropout), VOCAB, VOCAB, True,
                                    **options)
    model.to(device)
    if variant == "fp8":
        from transformer.experimental import fp8
        fp8.convert(model)
    optim = SimpleNamespace(beta1=0.9, beta2=0.98, eps=1e-9, weight_decay=0.0, factor=0.25, warmup=200, anneal=0.0)
    opt, schedule = build_optimizer(model, optim, 128)
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        src, tgt_in, tgt_out = (t.to(device) for t in copy_batch(g, sentences, 3, 16))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
            logits = model(src, tgt_in)  # (B, T, V)
        try:
            loss, _ = label_smoothed_cross_entropy(logits, tgt_out, 0.1, PAD, **LOSS.get(variant, {}))
        except TypeError:  # a version whose loss has one implementation
            return None
        loss = loss / (tgt_out != PAD).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def cannot_run(variant: str, device: str) -> Optional[str]:
    """Why `variant` cannot run on `device` (fp8: a CPU, a GPU before sm_89, no torchao), or None."""
    if variant != "fp8":
        return None
    try:
        from transformer.experimental import fp8
    except ImportError:  # a version of the package before trainer.precision=fp8
        return "this version has no trainer.precision=fp8"
    return fp8.refusal(torch.device(device))


def smooth(xs: List[float], window: int) -> List[float]:
    return [sum(xs[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))]


def compare(curves: Dict[str, List[float]], reference: List[float], window: int) -> Dict[str, dict]:
    """Per variant: the mean and the largest relative gap between its smoothed curve and the reference's, the
    first step whose raw loss differs by more than 1e-4 (relative; None: never), and the last-window means."""
    ref = smooth(reference, window)
    out = {}
    for name, xs in curves.items():
        gaps = [abs(a - b) / b for a, b in zip(smooth(xs, window), ref, strict=True)]
        apart = [i for i, (a, b) in enumerate(zip(xs, reference, strict=True)) if abs(a - b) / b > 1e-4]
        out[name] = {"mean_rel_gap": sum(gaps) / len(gaps), "max_rel_gap": max(gaps),
                     "first_apart": apart[0] if apart else None,
                     "last_mean": sum(xs[-window:]) / window, "ref_last_mean": sum(reference[-window:]) / window}
    return out


def line(name: str, r: dict, window: int) -> str:
    return (f"{name:14s} mean gap {r['mean_rel_gap']:6.2%}  max gap {r['max_rel_gap']:6.2%}  apart from step "
            f"{r['first_apart']}  last-{window} mean {r['last_mean']:.4f} (reference {r['ref_last_mean']:.4f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--variants", default="fp32,bf16,bf16_residual,unpadded")
    ap.add_argument("--dropout", type=float, default=0.1, help="P_drop (0: the same arithmetic up to rounding; "
                    "with dropout, the packed model of `unpadded` draws other masks)")
    ap.add_argument("--window", type=int, default=20, help="steps of the moving average compared")
    ap.add_argument("--out", help="write the curves as JSON here")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    ap.add_argument("--against", help="curves JSON of another run of this script: compare same-named variants")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the fp8 variant needs a GPU of sm_89+)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    curves, seconds = {}, {}
    for name in args.variants.split(","):
        if name not in SWITCHES:
            print(f"error: --variants: unknown variant {name!r} (known: {', '.join(SWITCHES)})", file=sys.stderr)
            return 2
        why = cannot_run(name, args.device)
        if why is not None:
            print(f"{name:14s} skipped: {why}")
            continue
        start = time.perf_counter()
        losses = train(name, args.steps, args.seed, dropout=args.dropout, device=args.device)
        seconds[name] = time.perf_counter() - start
        if losses is None:
            print(f"{name:14s} skipped: this version has no {SWITCHES[name][1] or LOSS[name]}")
            continue
        curves[name] = losses
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "device": args.device, "steps": args.steps, "seed": args.seed,
                       "dropout": args.dropout, "curves": curves, "seconds": seconds}, f)
    if not curves:
        print("error: --variants: none of them ran here", file=sys.stderr)
        return 2
    first = next(iter(curves))
    print(f"{args.steps} steps, seed {args.seed}, P_drop {args.dropout}, torch {torch.__version__}; gaps between "
          f"curves smoothed over {args.window} steps, relative to the reference ({first})")
    for name, r in compare(curves, curves[first], args.window).items():
        print(f"{line(name, r, args.window)}  {seconds[name]:.0f} s")
    if args.against:
        with open(args.against, encoding="utf-8") as f:
            other = json.load(f)["curves"]
        print(f"against {args.against} (reference: its curve of the same variant)")
        for name in [n for n in curves if n in other]:
            print(line(name, compare({name: curves[name]}, other[name], args.window)[name], args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
