"""BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword Regularization"): while
training, each word is segmented with every merge step dropped with probability p, so the model sees many
segmentations of the same word; validation, the length penalty's choice and decoding keep the plain one.

Hugging Face `tokenizers` has BPE dropout, but draws from an unseeded thread RNG, so a resumed run would see
other segmentations than the run it continues, and ranks would disagree. Here, as an approximation that
keeps every epoch a function of (seed, epoch):
- each distinct word of the training split gets `samples` dropout segmentations, drawn once with Python's
  generator seeded by `seed` (Algorithm 1 of the paper over the tokenizer's own merges);
- each epoch, every word occurrence takes one of its word's samples, drawn by numpy from (seed, epoch, side).
The epoch's ids are then assembled with array gathers (no Python loop over sentences). A sentence whose plain
re-segmentation does not reproduce its stored ids (characters unknown to the vocabulary decode to nothing)
keeps its stored ids in every epoch.
"""
import json
import logging
import random
import time
from typing import Dict, List, Tuple

import numpy as np

from transformer.data.batch import PairDataset, Ragged
from transformer.specials import UNK

log = logging.getLogger(__name__)


def merge_ranks(tok) -> Dict[Tuple[str, str], int]:
    """(left, right) -> priority (0 first) of a Hugging Face BPE tokenizer's merges."""
    merges = json.loads(tok.to_str())["model"]["merges"]
    return {tuple(m.split(" ", 1) if isinstance(m, str) else m): i for i, m in enumerate(merges)}


def segment(word: str, ranks: Dict[Tuple[str, str], int], p: float, rng: random.Random) -> List[str]:
    """Algorithm 1 of the paper: from characters, apply the highest-priority merge among those that survive
    dropout (each candidate dropped with probability p at every step); stop when none survives. With p=0 this
    is plain BPE (the leftmost of equal merges first, as `tokenizers` does)."""
    symbols = list(word)
    while len(symbols) > 1:
        best, at = None, -1
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best) and (p == 0 or rng.random() >= p):
                best, at = r, i
        if best is None:
            break
        symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
    return symbols


class BpeDropout:
    """`epoch(e)`: the training split with epoch e's segmentations, a `PairDataset` like the stored one.

    `tokenizer`: a `BpeTokenizer`; `train`: the stored training split (its ids define the sentences, so the
    filtering of preprocessing holds); `max_len`: a sentence whose sampled segmentation grows past it takes its
    plain one that epoch."""

    def __init__(self, tokenizer, train: PairDataset, p: float, samples: int, seed: int, max_len: int):
        start = time.perf_counter()
        self.samples, self.seed, self.max_len = samples, seed, max_len
        tok = tokenizer.tok
        ranks = merge_ranks(tok)
        vocab = tok.get_vocab()
        self.words: Dict[str, int] = {}
        pieces: List[List[List[int]]] = []  # word id -> samples + 1 segmentations as ids; the last is plain
        rng = random.Random(seed)

        def word_id(word: str) -> int:
            i = self.words.get(word)
            if i is None:
                i = self.words[word] = len(pieces)
                draws = [segment(word, ranks, p, rng) for _ in range(samples)] + [segment(word, ranks, 0.0, rng)]
                pieces.append([[vocab.get(s, UNK) for s in d] for d in draws])
            return i

        self.sides = {}
        fixed = 0
        for side, ragged in (("src", train.src), ("tgt", train.tgt)):
            texts = tok.decode_batch([ragged[i].tolist() for i in range(len(ragged))], skip_special_tokens=True)
            seqs = []
            for i, text in enumerate(texts):
                normal = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
                ids = [word_id(w) for w, _ in tok.pre_tokenizer.pre_tokenize_str(normal)]
                if [t for w in ids for t in pieces[w][-1]] != ragged[i].tolist():
                    # A pseudo-word whose every sample is the stored ids: this sentence never changes.
                    stored = ragged[i].tolist()
                    ids = [len(pieces)]
                    pieces.append([stored] * (samples + 1))
                    fixed += 1
                seqs.append(ids)
            self.sides[side] = Ragged.from_lists(seqs)  # word ids per sentence
        lengths = np.array([[len(s) for s in w] for w in pieces], dtype=np.int64)  # (words, samples + 1)
        self.lengths = lengths
        self.starts = np.zeros_like(lengths)
        self.starts.reshape(-1)[1:] = np.cumsum(lengths.reshape(-1))[:-1]
        self.flat = np.fromiter((t for w in pieces for s in w for t in s), dtype=np.int32,
                                count=int(lengths.sum()))
        log.info("BPE-dropout p=%g: %d distinct words x %d segmentations in %.1f s (%d sentences kept as stored)",
                 p, len(self.words), samples, time.perf_counter() - start, fixed)

    def epoch(self, epoch: int) -> PairDataset:
        return PairDataset(self._side("src", epoch), self._side("tgt", epoch))

    def _side(self, side: str, epoch: int) -> Ragged:
        words = self.sides[side]
        w = words.data.astype(np.int64)  # (W,) word ids of all sentences, flat
        rng = np.random.default_rng([self.seed, epoch, 0 if side == "src" else 1])
        pick = rng.integers(self.samples, size=len(w))  # (W,)
        lens = self.lengths[w, pick]
        sentence = _sums(lens, words.offsets)
        long = sentence > self.max_len
        if long.any():  # those sentences take their plain segmentation this epoch
            in_long = np.repeat(long, np.diff(words.offsets))
            pick[in_long] = self.samples
            lens = self.lengths[w, pick]
        return _gather(self.flat, self.starts[w, pick], lens, words.offsets)


def _sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-sentence sums of `values` (one per word), sentences given by word offsets."""
    c = np.concatenate([[0], np.cumsum(values)])
    return c[offsets[1:]] - c[offsets[:-1]]


def _gather(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, word_offsets: np.ndarray) -> Ragged:
    """Concatenates flat[starts[k]:starts[k] + lens[k]] over k, cut into sentences at the word offsets."""
    ends = np.cumsum(lens)  # (W,) token end of each word in the output
    total = int(ends[-1]) if len(ends) else 0
    shift = np.repeat(starts - (ends - lens), lens)  # (total,) source index minus output index
    data = flat[np.arange(total) + shift]
    offsets = np.concatenate([[0], ends])[word_offsets]
    return Ragged(data, offsets.astype(np.int64))

