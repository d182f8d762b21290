"""A small copy model trained in seconds (variable-length copies, so it has learned where </s> goes) and
checkpoints of it, shared by the decoding, translate, evaluate, average and plot tests."""
import functools
from dataclasses import asdict

import numpy as np
import pytest
import torch

from transformer.config import CheckpointConfig, EvalConfig, ModelConfig, OptimConfig, TrainerConfig
from transformer.data.batch import PAD, collate
from transformer.data.config import DataConfig, TokenizerConfig
from transformer.data.copy import CopyTokenizer
from transformer.model import Transformer
from transformer.training.components.checkpoint import FORMAT

VOCAB = 12  # 4 specials + symbols 4..11


def random_copy_items(n: int, seed: int, min_len: int = 1, max_len: int = 8):
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        s = rng.integers(4, VOCAB, size=int(rng.integers(min_len, max_len + 1))).astype(np.int32)
        items.append((i, s, s))
    return items


@functools.cache
def copy_model() -> Transformer:
    """A 1-layer model trained for a few seconds to copy sequences of 1-8 symbols (variable length, so
    it has to learn where </s> goes). Cached: every test module shares one training run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only add overhead on a shared CPU
    try:
        torch.manual_seed(0)
        cfg = ModelConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
        model = Transformer.from_config(cfg, VOCAB, VOCAB, shared_vocab=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
        for step in range(300):
            b = collate(random_copy_items(32, seed=step))
            logits = model(b.src, b.tgt_in)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), b.tgt_out.view(-1), ignore_index=PAD)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def full_config(**data) -> dict:
    """A resolved config dict as the trainer stores it in checkpoints."""
    return {"model": asdict(ModelConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)),
            "optim": asdict(OptimConfig()), "trainer": asdict(TrainerConfig()), "data": asdict(DataConfig(**data)),
            "tokenizer": asdict(TokenizerConfig()), "checkpoint": asdict(CheckpointConfig()),
            "eval": asdict(EvalConfig()), "seed": 1234}


def copy_checkpoint(model=None, step: int = 300, **data) -> dict:
    model = copy_model() if model is None else model
    return {"format": FORMAT, "model_args": model.args.to_dict(), "model": model.state_dict(),
            "tokenizer": CopyTokenizer(VOCAB).state_dict(), "config": full_config(**data),
            "trainer": {"step": step, "epoch": 0}}


@pytest.fixture(autouse=True)
def one_thread():
    """Autouse in every test module that imports it. Tiny matrices: on a busy 2-core machine, thread
    hand-offs cost more than the maths (35x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
