"""`Vocab.build` over a stream: spaCy vocabularies of a corpus too big to hold as token lists.

Token strings get provisional ids in order of first appearance; the statistics `Vocab.build` takes from
whole lists (counts, and how often each token glues to its left or right neighbour) are sums over
adjacent token pairs within a sentence, so they accumulate chunk by chunk as `np.bincount`s. Right-glue
needs the finished left-glue set, so it is counted in a second pass over the chunks' provisional ids,
which preprocessing spills to disk on the first pass (transformer/data/preprocess.py).
"""
from typing import Dict, List, Optional, Sequence

import numpy as np

from transformer.data.batch import SPECIALS, UNK
from transformer.data.tokenizer import NO_SPACE_AFTER, NO_SPACE_BEFORE, QUOTE, Vocab


def _first_last(lengths: np.ndarray, n_tokens: int):
    """Masks of the tokens that start and that end their sentence."""
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    nonempty = lengths > 0
    first, last = np.zeros(n_tokens, bool), np.zeros(n_tokens, bool)
    first[starts[nonempty]] = True
    last[ends[nonempty] - 1] = True
    return first, last


class VocabCounter:
    """One language's counts. `add` (first pass) returns the chunk's provisional ids; `add_right` (second
    pass, same chunks) completes the statistics; `words`, `id_table` and `vocab` give the result."""

    def __init__(self):
        self.index: Dict[str, int] = {}
        self._stats = np.zeros((5, 1024), np.int64)  # counts, left_seen, glue_left, right_seen, glue_right
        self._left: Optional[np.ndarray] = None

    def _grow(self) -> None:
        if len(self.index) > self._stats.shape[1]:
            grown = np.zeros((5, max(len(self.index), 2 * self._stats.shape[1])), np.int64)
            grown[:, :self._stats.shape[1]] = self._stats
            self._stats = grown

    def _bump(self, row: int, ids: np.ndarray) -> None:
        counts = np.bincount(ids, minlength=0)
        self._stats[row, :len(counts)] += counts

    def _quote(self) -> int:
        return self.index.get(QUOTE, -1)

    def add(self, strings: Sequence[str], local: np.ndarray, lengths: np.ndarray, nospace: np.ndarray) -> np.ndarray:
        """A chunk as `encode.spacy_chunk` returns it; returns its tokens' provisional ids (int32)."""
        remap = np.fromiter((self.index.setdefault(s, len(self.index)) for s in strings), np.int32, len(strings))
        ids = remap[local] if len(local) else np.zeros(0, np.int32)
        self._grow()
        self._bump(0, ids)
        first, _ = _first_last(lengths, len(ids))
        # token i (not first in its sentence) after a non-quote: does it follow its left neighbour unspaced?
        ok = ~first[1:] & (ids[:-1] != self._quote())
        self._bump(1, ids[1:][ok])
        self._bump(2, ids[1:][ok & nospace[:-1]])
        return ids

    def left_set(self) -> np.ndarray:
        """Tokens that mostly glue to their left neighbour (fixed once the first pass is over)."""
        n = len(self.index)
        self._left = 2 * self._stats[2, :n] > self._stats[1, :n]
        return self._left

    def add_right(self, ids: np.ndarray, lengths: np.ndarray, nospace: np.ndarray) -> None:
        """Right-glue is only counted where the right neighbour is not itself a left-gluer (see Vocab.build)."""
        if self._left is None:
            self.left_set()
        _, last = _first_last(lengths, len(ids))
        nxt = ids[1:]
        ok = ~last[:-1] & ~self._left[nxt] & (nxt != self._quote())
        self._bump(3, ids[:-1][ok])
        self._bump(4, ids[:-1][ok & nospace[:-1]])

    def words(self, min_freq: int, max_size: Optional[int]) -> np.ndarray:
        """Provisional ids of the vocabulary's words in id order: seen >= min_freq times, most frequent first
        (ties: by string), as `Vocab.build` orders them. Needs only the first pass."""
        n = len(self.index)
        counts, strings = self._stats[0, :n], list(self.index)
        kept = [int(i) for i in np.nonzero(counts >= min_freq)[0] if strings[i] not in SPECIALS]
        kept.sort(key=lambda i: (-counts[i], strings[i]))
        if max_size is not None:
            kept = kept[:max(0, max_size - len(SPECIALS))]
        return np.asarray(kept, dtype=np.int64)

    def id_table(self, words: np.ndarray) -> np.ndarray:
        """Provisional id -> vocabulary id: the words after the specials, everything else <unk> (a special's
        own string in the text maps to the special, as `Vocab.encode` does)."""
        table = np.full(len(self.index), UNK, np.int32)
        table[words] = np.arange(len(SPECIALS), len(SPECIALS) + len(words), dtype=np.int32)
        for k, s in enumerate(SPECIALS):
            if s in self.index:
                table[self.index[s]] = k
        return table

    def vocab(self, words: np.ndarray) -> Vocab:
        """The `Vocab` that `Vocab.build` makes from the same sentences; needs both passes."""
        n = len(self.index)
        left = self.left_set()
        right = 2 * self._stats[4, :n] > self._stats[3, :n]
        strings = list(self.index)
        flags = [NO_SPACE_BEFORE * bool(left[i]) + NO_SPACE_AFTER * bool(right[i]) for i in words]
        return Vocab(SPECIALS + [strings[i] for i in words], [0] * len(SPECIALS) + flags)


def strings_to_ids(vocab: Vocab, strings: List[str], local: np.ndarray) -> np.ndarray:
    """A chunk's ids under a finished vocabulary (the valid split, or train with a given tokenizer)."""
    table = np.fromiter((vocab.stoi.get(s, UNK) for s in strings), np.int32, len(strings))
    return table[local] if len(local) else np.zeros(0, np.int32)
