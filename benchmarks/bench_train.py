"""CPU training speed on Multi30k de->en: `model=small` at 4096-token batches through the real trainer step vs
the Annotated Transformer's recipe at the same model size. Prints measured numbers, asserts nothing.

    python benchmarks/bench_train.py [--multi30k DIR] [--steps 12] [--threads 2]

ours:       the trainer's own optimiser step (Trainer._train_step: label-smoothed cross-entropy, gradient
            normalisation, clipping at 1.0, Adam, Noam schedule) on token-bucketed batches of
            data.max_tokens=4096 (composed by Hydra as transformer-train does: spaCy vocabularies, warmup 1000,
            the first Multi30k recipe's big batches, against which the Annotated Transformer's were first compared).
annotated:  the Annotated Transformer's recipe: batches of 32 random sentences, both sides padded to 72
            (`<s> x </s>`), its KL-divergence label smoothing over a (B*T, V) target distribution, the loss
            divided by the batch's tokens, Adam stepped every accum_iter=10 batches.
Both run the same model code (N=3, d_model=256, d_ff=1024, h=8, this repository's Transformer), so the
ratio measures batching, loss and loop, not attention kernels. Steps alternate between the two, so a
change in machine load hits both alike; only the steps are timed (not batch making).
"""
import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from bench_data import annotated_batches, interleaved, offline_root, report  # noqa: E402
from torch import nn  # noqa: E402

from transformer.data.batch import PAD  # noqa: E402
from transformer.dist import DistEnv  # noqa: E402
from transformer.training.loop.hotpath import LaggedFlag, TrainWindow  # noqa: E402

ACCUM_ITER = 10  # the Annotated Transformer's Multi30k config: an optimiser step every 10 batches


def compose(root: Path, cache: Path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from transformer.config import register_configs
    register_configs()
    OmegaConf.register_new_resolver("run_name", lambda: "bench", replace=True)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[
            "data=multi30k", "model=small", "tokenizer=spacy", "optim.warmup=1000", "trainer.clip_norm=1.0",
            f"data.root={root}", f"data.cache_dir={cache}",
            "trainer.progress=false"])


class AnnotatedLabelSmoothing(nn.Module):
    """The Annotated Transformer's LabelSmoothing: KL divergence to a full (B*T, V) target distribution."""

    def __init__(self, size: int, padding_idx: int, smoothing: float):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.size, self.padding_idx, self.smoothing = size, padding_idx, smoothing

    def forward(self, x, target):
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), 1.0 - self.smoothing)
        true_dist[:, self.padding_idx] = 0
        mask = torch.nonzero(target.data == self.padding_idx)
        if mask.dim() > 0:
            true_dist.index_fill_(0, mask.squeeze(), 0.0)
        return self.criterion(x, true_dist.clone().detach())


class Annotated:
    """The Annotated Transformer's run_epoch step on our model of the same size."""

    def __init__(self, cfg, data):
        from transformer.model import Transformer
        from transformer.training.components.optim import noam_lr
        torch.manual_seed(cfg.seed)
        self.model = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size,
                                             data.shared_vocab).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: noam_lr(s + 1, cfg.model.d_model, 3000))
        self.criterion = AnnotatedLabelSmoothing(data.tgt_vocab_size, PAD, 0.1)
        self.i = 0

    def step(self, batch) -> None:
        # Their loop steps the schedule every batch, also between optimiser steps; torch warns about that.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
        logits = self.model(batch.src, batch.tgt_in)  # (B, T, V)
        lprobs = logits.log_softmax(dim=-1)  # their Generator ends in log_softmax
        loss = self.criterion(lprobs.reshape(-1, lprobs.size(-1)), batch.tgt_out.reshape(-1)) / batch.n_tokens
        loss.backward()
        self.i += 1
        if self.i % ACCUM_ITER == 0:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.sched.step()


def endless(loader_of_epoch):
    for epoch in range(10**6):
        yield from loader_of_epoch(epoch)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--multi30k",
                   default=os.environ.get("MULTI30K_DIR") or str(REPO.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--steps", type=int, default=12, help="timed steps of each (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args()
    if not (Path(args.multi30k) / "train.de.gz").exists():
        sys.exit(f"no Multi30k files in {args.multi30k} (--multi30k DIR)")
    torch.set_num_threads(args.threads)
    from transformer.data.translation import build_translation_data
    from transformer.tasks import build_task
    from transformer.training.distributed.parallelize import build_model, parallelize
    from transformer.training.loop.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = compose(offline_root(Path(args.multi30k), tmp), tmp / "cache")
        data = build_translation_data(cfg, DistEnv(), None)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, data)
        trainer = Trainer(cfg, DistEnv(), parallelize(model, cfg, DistEnv()), data, build_task(cfg), None)
        window, flag = TrainWindow(), LaggedFlag()
        ours = (lambda batch: trainer._train_step([batch], window, flag), endless(data.train_loader))
        annotated = (Annotated(cfg, data).step, endless(lambda epoch: annotated_batches(data, seed=epoch)))
        runs = interleaved({"ours": ours, "annotated": annotated}, args.steps)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, model=small (N=3, d_model=256, d_ff=1024, h=8), "
          f"vocab {data.src_vocab_size}/{data.tgt_vocab_size}")
    ratio = report(runs, args.steps, "train step CPU model=small")
    print(f"ratio ours / annotated: {ratio:.2f}x real target tokens/s")


if __name__ == "__main__":
    main()
