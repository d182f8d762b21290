"""The synthetic copy task: the target is the source (Annotated Transformer, "A First Example")."""
import numpy as np

from transformer.data.batch import BOS, PAD, SPECIALS, PairDataset, Ragged
from transformer.data.module import DataModule
from transformer.specials import until_eos


class CopyTokenizer:
    """Symbols are their own ids, written as numbers."""
    name = "copy"
    shared_vocab = True

    def __init__(self, vocab_size: int):
        self.src_vocab_size = self.tgt_vocab_size = vocab_size

    def encode_src(self, text: str) -> list:
        return [int(t) for t in text.split()]

    encode_tgt = encode_src

    def encode_src_batch(self, texts) -> list:
        return [self.encode_src(t) for t in texts]

    encode_tgt_batch = encode_src_batch

    def decode_tgt(self, ids) -> str:
        """Stops at </s>; drops <pad> and <s>."""
        return " ".join(map(str, until_eos(ids, (PAD, BOS))))

    decode_src = decode_tgt

    def tgt_tokens(self, ids) -> list:
        return [SPECIALS[i] if i < len(SPECIALS) else str(i) for i in map(int, ids)]

    src_tokens = tgt_tokens

    def save(self, folder) -> None:
        pass  # nothing to save: the vocabulary is the numbers themselves

    def state_dict(self) -> dict:
        return {"name": "copy", "vocab_size": self.src_vocab_size}


def random_sequences(n: int, seq_len: int, vocab_size: int, seed: int) -> Ragged:
    rng = np.random.default_rng(seed)
    seqs = rng.integers(len(SPECIALS), vocab_size, size=(n, seq_len), dtype=np.int32)
    return Ragged(seqs.reshape(-1), np.arange(n + 1, dtype=np.int64) * seq_len)


def copy_split(n: int, cfg, seed: int) -> PairDataset:
    seqs = random_sequences(n, cfg.seq_len, cfg.vocab_size, seed)
    return PairDataset(seqs, seqs)


class CopyData(DataModule):
    task = "copy"

    def __init__(self, cfg, seed: int, rank: int, world_size: int):
        c = cfg.data["copy"]  # not .copy: DictConfig.copy is a method
        if c.vocab_size <= len(SPECIALS):
            raise ValueError(f"data.copy.vocab_size={c.vocab_size}: must exceed the {len(SPECIALS)} special tokens")
        # Splits come from different seeds, so validation and test sequences are fresh.
        train, valid = copy_split(c.train_size, c, seed), copy_split(c.val_size, c, seed + 1)
        self.test = copy_split(c.test_size, c, seed + 2)
        super().__init__(train, valid, CopyTokenizer(c.vocab_size), max_tokens=cfg.data.max_tokens,
                         max_sentences=cfg.data.max_sentences, seed=seed, rank=rank, world_size=world_size,
                         max_tokens_by_epoch=cfg.data.max_tokens_by_epoch)
