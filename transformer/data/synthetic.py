"""Random parallel data for speed measurements (`transformer-bench bench.synthetic=true`): no corpus, no
tokeniser, any vocabulary size, and a chosen sentence-length distribution, batched like real data."""
import numpy as np

from transformer.data.batch import SPECIALS, PairDataset, Ragged
from transformer.data.copy import CopyTokenizer
from transformer.data.module import DataModule


def synthetic_lengths(n: int, b, rng: np.random.Generator):
    """Source lengths ~ normal(length_mean, length_std); target = source + normal(0, length_std / 4), as
    translation pairs have correlated lengths; both rounded and clipped to [min_len, max_len]."""
    src = np.clip(np.rint(rng.normal(b.length_mean, b.length_std, n)), b.min_len, b.max_len).astype(np.int64)
    tgt = np.clip(np.rint(src + rng.normal(0.0, b.length_std / 4, n)), b.min_len, b.max_len).astype(np.int64)
    return src, tgt


def _random_side(lengths: np.ndarray, vocab_size: int, rng: np.random.Generator) -> Ragged:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(rng.integers(len(SPECIALS), vocab_size, size=int(offsets[-1]), dtype=np.int32), offsets)


class SyntheticData(DataModule):
    """`cfg.bench.sentences` random pairs (the same on every rank: drawn from `cfg.seed`), sharded and
    token-bucketed by `data.max_tokens` exactly as a real corpus would be. The validation split is the
    first 1% of them (validation is not what a benchmark measures). `num_workers` DataLoader workers collate the
    batches, as in training (data.num_workers, transformer.data.module.loader_workers)."""

    def __init__(self, cfg, rank: int, world_size: int, pin_memory: bool = False, num_workers: int = 0):
        b = cfg.bench
        rng = np.random.default_rng(cfg.seed)
        src_len, tgt_len = synthetic_lengths(b.sentences, b, rng)
        src, tgt = _random_side(src_len, b.vocab_size, rng), _random_side(tgt_len, b.vocab_size, rng)
        n_valid = max(1, b.sentences // 100)
        valid = PairDataset(Ragged(src.data, src.offsets[:n_valid + 1]), Ragged(tgt.data, tgt.offsets[:n_valid + 1]))
        super().__init__(PairDataset(src, tgt), valid, CopyTokenizer(b.vocab_size), max_tokens=cfg.data.max_tokens,
                         max_sentences=cfg.data.max_sentences, seed=cfg.seed, rank=rank, world_size=world_size,
                         pin_memory=pin_memory, num_workers=num_workers)
