"""The fused loss against the log_softmax reference over a short training run: a small model on a copy task,
the same seed and batches for both, the per-step loss compared (the issue's bar: curves within 2 %).

    python benchmarks/loss_curve.py [--steps 300] [--threads 1]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer.config import ModelConfig  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.training.loss import label_smoothed_cross_entropy  # noqa: E402


def curve(impl: str, steps: int) -> list:
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=1, d_model=64, d_ff=128, h=4, dropout=0.1), 40, 40)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        src = torch.randint(4, 40, (32, 12), generator=g)  # (B, S); half the rows padded after 9 tokens
        src[:16, 9:] = 0
        tgt_in = torch.cat([torch.ones(32, 1, dtype=torch.long), src[:, :-1]], 1)
        tgt_in[:16, 10:] = 0
        loss, _ = label_smoothed_cross_entropy(model(src, tgt_in), src, 0.1, 0, impl=impl, inplace=True)
        loss = loss / (src != 0).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fused, ref = curve("fused", args.steps), curve("reference", args.steps)
    rel = max(abs(a - b) / b for a, b in zip(fused, ref, strict=True))
    marks = sorted({0, args.steps // 3, 2 * args.steps // 3, args.steps - 1})
    print(f"{args.steps} steps; loss at steps {[i + 1 for i in marks]}: fused {[round(fused[i], 4) for i in marks]}, "
          f"reference {[round(ref[i], 4) for i in marks]}; largest relative difference {rel:.2e}")


if __name__ == "__main__":
    main()
