"""Small BPE and SentencePiece tokenizers and models trained on them in seconds, for the export and import tests."""
import functools
from typing import Optional

import numpy as np
import torch

from transformer.config import ModelConfig
from transformer.data.batch import PAD, collate
from transformer.data.tokenizer import BpeTokenizer
from transformer.model import Transformer
from transformer.training.components.checkpoint import FORMAT

PAIRS = [
    ("Ein Mann fährt Fahrrad.", "A man rides a bike."),
    ("Zwei Hunde spielen im Schnee.", "Two dogs play in the snow."),
    ("Eine Frau liest ein Buch.", "A woman reads a book."),
    ("Kinder spielen am Strand.", "Children play on the beach."),
    ("Ein Hund rennt über die Wiese.", "A dog runs across the meadow."),
    ("Zwei Männer trinken Kaffee.", "Two men drink coffee."),
    ("Eine Frau fährt ein rotes Auto.", "A woman drives a red car."),
    ("Ein Junge springt ins Wasser.", "A boy jumps into the water."),
    ("Ein Mädchen singt ein Lied.", "A girl sings a song."),
    ("Drei Leute warten auf den Bus.", "Three people wait for the bus."),
]
SRC = [s for s, _ in PAIRS]
# A few hundred numbered variations of PAIRS: what the SentencePiece vocabularies learn from.
LINES = [f"{s[:-1]} {i % 13} {word}." for i in range(150) for s, word in ((PAIRS[i % 10][0], "mal"),
                                                                          (PAIRS[i % 10][1], "times"))]


@functools.cache
def tokenizer(seen: bool = False) -> BpeTokenizer:
    """Shared BPE over both sides; `seen`: tokenizer.tgt_vocab=seen (English types numbered first)."""
    tok = BpeTokenizer.train(SRC + [t for _, t in PAIRS], 120, 1, src_lang="de", tgt_lang="en")
    return tok.seen_targets_first([[t for _, t in PAIRS]]) if seen else tok


@functools.cache
def spm_tokenizer(seen: bool = False, model_type: str = "unigram", byte_fallback: bool = False):
    """tokenizer=sentencepiece learnt from LINES (120 pieces, or 376 with byte_fallback); `seen` as above."""
    from transformer.data.spm import SentencePieceTokenizer
    tok = SentencePieceTokenizer.train(LINES, 120 + 256 * byte_fallback, model_type, byte_fallback=byte_fallback,
                                       threads=1, src_lang="de", tgt_lang="en")
    return tok.seen_targets_first([[t for _, t in PAIRS]]) if seen else tok


def vocabulary(kind: str = "bpe", seen: bool = False):
    """The tokenizer of a model of `kind` (bpe, or a unigram sentencepiece)."""
    return spm_tokenizer(seen) if kind == "sentencepiece" else tokenizer(seen)


@functools.cache
def trained_model(tie: str = "decoder", seen: bool = False, norm_first: bool = False, steps: int = 60,
                  activation: str = "relu", output_bias: bool = False, kind: str = "bpe") -> Transformer:
    """A 2+1-layer model that has memorised PAIRS (so its outputs are sentences, not one repeated token), on
    `vocabulary(kind, seen)`."""
    tok = vocabulary(kind, seen)
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, N_dec=1, d_model=32, d_ff=64, h=4, dropout=0.0, tie_embeddings=tie, norm_first=norm_first,
                      max_positions=64, activation=activation, output_bias=output_bias)
    model = Transformer.from_config(cfg, tok.src_vocab_size, tok.tgt_vocab_size, shared_vocab=True)
    pairs = zip(tok.encode_src_batch(SRC), tok.encode_tgt_batch([t for _, t in PAIRS]), strict=True)
    items = [(i, np.array(s, dtype=np.int32), np.array(t, dtype=np.int32)) for i, (s, t) in enumerate(pairs)]
    batch = collate(items)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(batch.src, batch.tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def checkpoint(model: Transformer, tok) -> dict:
    """What load_model needs of a checkpoint."""
    return {"format": FORMAT, "model_args": model.args.to_dict(), "model": model.state_dict(),
            "tokenizer": tok.state_dict(), "config": {}}


def read_gz(path) -> list:
    import gzip
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def multi30k_model(folder, seconds: float = float("inf"), vocab_size: int = 2000, seed: int = 0, name: str = "bpe",
                   steps: Optional[int] = None):
    """A model=tiny-sized model (tie_embeddings=all, tokenizer.tgt_vocab=seen, as the recipe) trained on
    Multi30k de->en for `seconds` of wall time or `steps` steps, whichever ends first, in this process: (model
    in eval mode, tokenizer, steps).
    `name`: tokenizer.name, bpe or sentencepiece (unigram)."""
    import time

    from transformer.data.config import TokenizerConfig
    from transformer.data.tokenizer import train_tokenizer

    src, tgt = read_gz(f"{folder}/train.de.gz"), read_gz(f"{folder}/train.en.gz")
    tok = train_tokenizer(TokenizerConfig(name=name, vocab_size=vocab_size, tgt_vocab="seen"), "de", "en", src, tgt)
    torch.manual_seed(seed)
    cfg = ModelConfig(N=2, d_model=128, d_ff=256, h=4, dropout=0.1, tie_embeddings="all", max_positions=256)
    model = Transformer.from_config(cfg, tok.src_vocab_size, tok.tgt_vocab_size, shared_vocab=True)
    pairs = zip(tok.encode_src_batch(src), tok.encode_tgt_batch(tgt), strict=True)
    items = sorted(((i, np.array(s, dtype=np.int32), np.array(t, dtype=np.int32)) for i, (s, t) in enumerate(pairs)),
                   key=lambda it: len(it[1]))
    batches = [items[i:i + 64] for i in range(0, len(items), 64)]
    order = np.random.default_rng(seed).permutation(len(batches))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.98))
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < seconds and (steps is None or step < steps):
        b = collate(batches[order[step % len(order)]])
        for g in opt.param_groups:
            g["lr"] = 2e-3 * min(1.0, (step + 1) / 100)
        logits = model(b.src, b.tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD,
                                                 label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    return model.eval(), tok, step
