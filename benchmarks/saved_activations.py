"""What a training forward saves for its backward, by dtype and shape: prints, asserts nothing.

    python benchmarks/saved_activations.py model=base model.N=2 --batch 16x32 trainer.bf16_residual=true
    python benchmarks/saved_activations.py model=base --batch 16x32 --eager     # without torch.compile

Every tensor the autograd graph keeps for the backward passes through a saved-tensors hook here (torch.compile's
compiled functions save theirs the same way), counted once per storage. The forward runs under bf16 autocast on
the CPU, with the model the config composes and its bf16 stream switch: the CPU's inductor picks what to save
with the partitioner the GPU's uses, so the dtypes and shapes are those of a GPU run, the bytes scale with the
batch's B x T. Saved bytes are written by the forward and read back by the backward: on a GPU, where the
elementwise kernels are bound by memory traffic, they are time as well as memory. Weights' bf16 copies count too.
"""
import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: an older checkout of the package may be measured

import torch  # noqa: E402

from tests.helpers.cli import compose_cfg  # noqa: E402
from transformer.model import ModelOptions, Transformer  # noqa: E402


def saved_bytes(model, src: torch.Tensor, tgt: torch.Tensor) -> collections.Counter:
    """(dtype, shape) -> bytes the forward saves, one count per storage; runs the backward too."""
    by, seen = collections.Counter(), set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            by[(str(t.dtype).replace("torch.", ""), tuple(t.shape))] += t.numel() * t.element_size()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(src, tgt)  # (B, T, V)
    logits.float().sum().backward()
    return by


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["model=base", "model.N=2"])
    p.add_argument("--batch", default="16x32", help="B x T of the source and target batches")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--eager", action="store_true", help="without torch.compile")
    p.add_argument("--top", type=int, default=12, help="how many (dtype, shape) rows to list")
    args = p.parse_args(argv)
    cfg = compose_cfg(*args.overrides, "trainer.accelerator=cpu")
    B, T = (int(n) for n in args.batch.split("x"))
    torch.manual_seed(cfg.seed)
    model = Transformer.from_config(cfg.model, args.vocab, args.vocab, True,
                                    options=ModelOptions(bf16_residual=bool(cfg.trainer.bf16_residual)))
    net = model if args.eager else torch.compile(model)
    src, tgt = torch.randint(4, args.vocab, (B, T)), torch.randint(4, args.vocab, (B, T))
    start = time.perf_counter()
    saved_bytes(net, src, tgt)  # the first call compiles
    by = saved_bytes(net, src, tgt)
    mb = 2 ** 20
    per_dtype = collections.Counter()
    for (dtype, _), n in by.items():
        per_dtype[dtype] += n
    print(f"{' '.join(args.overrides)}, B x T {B}x{T}, {'eager' if args.eager else 'compiled'}, torch "
          f"{torch.__version__}, {time.perf_counter() - start:.0f} s")
    print(f"saved for the backward: {sum(by.values()) / mb:.2f} MB: "
          + ", ".join(f"{d} {n / mb:.2f}" for d, n in per_dtype.most_common()))
    for (dtype, shape), n in by.most_common(args.top):
        print(f"  {dtype:9} {str(shape):22} {n / mb:8.2f} MB")


if __name__ == "__main__":
    main()
