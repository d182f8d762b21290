"""Forward + backward time of the label-smoothed cross-entropy (transformer/training/components/loss.py) on (rows,
vocab)
logits: the fused function (its gradient in a new tensor, or written into the logits as the trainer asks), the
log_softmax reference, the fused passes through torch.compile (trainer.loss=compiled; in place too, the
trainer's call), and optionally another version
of loss.py (`--other PATH`, e.g. main's) for a before/after comparison. Median and spread of `--repeats`
timings, one line each.

    python benchmarks/bench_loss.py --rows 2048 --vocab 4249 --dtype bf16 [--threads 1] [--other /path/to/loss.py]
    python benchmarks/bench_loss.py --rows 16384 --vocab 32000 --d-model 1024 --dtype bf16   # big@16k on a GPU
"""
import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer.training.components.loss import label_smoothed_cross_entropy  # noqa: E402


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("other_loss", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.label_smoothed_cross_entropy


def time_one(fn, hidden, weight, target, repeats: int, device) -> list:
    """Seconds of loss forward + backward (through the generator's product, as in training) per repeat."""
    out = []
    for i in range(repeats + 1):  # the first is a warm-up
        h = hidden.detach().requires_grad_()
        logits = h @ weight.T  # (rows, V): a non-leaf, as the model's
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _ = fn(logits, target)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=4249)
    p.add_argument("--d-model", type=int, default=256, help="the generator's input width")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--other", help="another loss.py to time beside this one (its default call)")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.d_model, device=device, dtype=dtype)
    weight = (torch.randn(args.vocab, args.d_model, device=device) / args.d_model ** 0.5).to(dtype)
    target = torch.randint(4, args.vocab, (args.rows,), device=device)
    target[::7] = 0  # some padding
    fns = {"fused": lambda x, t: label_smoothed_cross_entropy(x, t, 0.1, 0),
           "fused_inplace": lambda x, t: label_smoothed_cross_entropy(x, t, 0.1, 0, inplace=True),
           "compiled": lambda x, t: label_smoothed_cross_entropy(x, t, 0.1, 0, impl="compiled"),
           "compiled_inplace": lambda x, t: label_smoothed_cross_entropy(x, t, 0.1, 0, impl="compiled", inplace=True),
           "reference": lambda x, t: label_smoothed_cross_entropy(x, t, 0.1, 0, impl="reference")}
    if args.other:
        other = load_other(args.other)
        fns["other"] = lambda x, t: other(x, t, 0.1, 0)
    print(f"loss fwd+bwd (with the generator's product), {args.rows} x {args.vocab} {args.dtype} on {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms: median (min-max) of {args.repeats}")
    order = list(fns)
    times = {k: [] for k in order}
    for _ in range(args.repeats):  # interleaved, so drift in a shared machine's load hits every version alike
        for k in order:
            times[k] += time_one(fns[k], hidden, weight, target, 1, device)
    for k in order:
        ms = [1e3 * t for t in times[k]]
        print(f"  {k:16s} {statistics.median(ms):8.2f}  ({min(ms):.2f}-{max(ms):.2f})")


if __name__ == "__main__":
    main()
