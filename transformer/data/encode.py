"""Tokenisation kernels: one chunk of sentences in, flat numpy arrays out. Preprocessing worker processes
run these; they import neither torch nor the rest of the package, so a spawned worker costs tens of MB.

A chunk's result is small and picklable: for BPE the ids themselves; for spaCy the chunk's distinct
token strings plus, per token, its index among them and whether no whitespace followed it (the parent
maps strings to vocabulary ids, and the whitespace flags teach the detokeniser).
"""
import os
from itertools import chain
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from transformer.specials import UNK

_LOADED: Dict[tuple, object] = {}  # per process: spaCy tokenizers and BPE models already loaded


def spacy_tokenizer(lang: str):
    key = ("spacy", lang)
    if key not in _LOADED:
        import spacy
        _LOADED[key] = spacy.blank(lang).tokenizer
    return _LOADED[key]


def spacy_tokenize(nlp, texts: Sequence[str], lowercase: bool, with_spaces: bool = False):
    """Token strings of each text (spaCy's whitespace tokens dropped); with `with_spaces`, also whether
    each token was followed by whitespace."""
    toks, spaces = [], []
    for doc in nlp.pipe((t.lower() if lowercase else t for t in texts), batch_size=1000):
        words = [t for t in doc if not t.is_space]
        toks.append([t.text for t in words])
        if with_spaces:
            # A token followed by a whitespace token (double space, tab) is also followed by space.
            spaces.append([bool(t.whitespace_) or (t.i + 1 < len(doc) and doc[t.i + 1].is_space) for t in words])
    return (toks, spaces) if with_spaces else toks


def spacy_chunk(lang: str, lowercase: bool, texts: Sequence[str]) -> Tuple[List[str], np.ndarray, np.ndarray,
                                                                           np.ndarray]:
    """(distinct tokens, index of each token among them, tokens per sentence, no-space-after flags)."""
    toks, spaces = spacy_tokenize(spacy_tokenizer(lang), texts, lowercase, with_spaces=True)
    index: Dict[str, int] = {}
    local = np.fromiter(map(lambda t: index.setdefault(t, len(index)), chain.from_iterable(toks)), dtype=np.int32)
    lengths = np.fromiter(map(len, toks), dtype=np.int32, count=len(toks))
    nospace = ~np.fromiter(chain.from_iterable(spaces), dtype=bool, count=len(local))
    return list(index), local, lengths, nospace


def bpe_chunk(state_file: str, n_ids: Optional[int], texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """(ids of all sentences concatenated, tokens per sentence) under the BPE model saved in `state_file`;
    ids from `n_ids` up become <unk> (a target side limited to the types its training side uses)."""
    key = ("bpe", state_file)
    if key not in _LOADED:
        from tokenizers import Tokenizer
        _LOADED[key] = Tokenizer.from_file(state_file)
    return _flat([e.ids for e in _LOADED[key].encode_batch(list(texts), add_special_tokens=False)], n_ids)


def _flat(ids: List[List[int]], n_ids: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    if n_ids is not None:
        flat[flat >= n_ids] = UNK
    return flat, lengths


def sentencepiece_chunk(model_file: str, n_ids: Optional[int], texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """`bpe_chunk` under the SentencePiece model saved in `model_file`."""
    key = ("sentencepiece", model_file)
    if key not in _LOADED:
        import sentencepiece
        _LOADED[key] = sentencepiece.SentencePieceProcessor(model_file=model_file)
    return _flat(_LOADED[key].encode(list(texts), out_type=int), n_ids)


def sentencepiece_pair_chunk(state_file: str, side: str, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """`bpe_chunk` under the source or target side ("src", "tgt") of the sentencepiece_pair tokenizer whose
    state (JSON) is in `state_file` (transformer/data/spm_pair.py)."""
    from transformer.data.spm_pair import encode_chunk
    return _flat(encode_chunk(state_file, side, texts), None)


def worker_init() -> None:
    """In a worker process: the processes are the parallelism, so HF tokenizers runs single-threaded."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def encode_pair_chunk(src_spec: tuple, tgt_spec: tuple, src: Sequence[str], tgt: Sequence[str]):
    """Both sides of a chunk of pairs; a spec is ("spacy", lang, lowercase), ("bpe", state_file, n_ids) or
    ("sentencepiece", model_file, n_ids) or ("sentencepiece_pair", state_file, side)."""
    return tuple(_KERNELS[spec[0]](*spec[1:], texts) for spec, texts in ((src_spec, src), (tgt_spec, tgt)))


_KERNELS = {"spacy": spacy_chunk, "bpe": bpe_chunk, "sentencepiece": sentencepiece_chunk,
            "sentencepiece_pair": sentencepiece_pair_chunk}
