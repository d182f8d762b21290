"""Tokenizers: word-level spaCy vocabularies (the Annotated Transformer's setup) and shared BPE (the paper's);
shared SentencePiece lives in transformer/data/spm.py.

Every vocabulary starts with the specials <pad> <unk> <s> </s> at ids 0, 1, 2, 3 (transformer/specials.py).
Encoders add no specials: the collate function appends </s> to the source and frames the target.
`state_dict()` holds primitives only, so a checkpoint alone rebuilds the tokenizer (`tokenizer_from_state`).
"""
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np

from transformer.atomic import write_text_atomic
from transformer.data.batch import BOS, PAD, SPECIALS, UNK
from transformer.data.encode import spacy_tokenize, spacy_tokenizer
from transformer.specials import until_eos

# Detokeniser flags of a spaCy vocabulary entry (see SpacyTokenizer).
NO_SPACE_BEFORE, NO_SPACE_AFTER = 1, 2
QUOTE = '"'  # ambiguous: opening or closing, decided by parity within the sentence


def _strip_specials(ids: Iterable[int]) -> List[int]:
    """Ids up to the first </s>, without <pad> and <s> (the decoder's output may contain either)."""
    return until_eos(ids, (PAD, BOS))


class Vocab:
    """Token <-> id for one language, plus each token's detokeniser flags."""

    def __init__(self, itos: Sequence[str], flags: Optional[Sequence[int]] = None):
        if list(itos[:len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}, got {list(itos[:len(SPECIALS)])}")
        self.itos = list(itos)
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.flags = list(flags) if flags is not None else [0] * len(self.itos)

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], spaces: Iterable[Sequence[bool]], min_freq: int,
              max_size: Optional[int]) -> "Vocab":
        """Words of the training sentences seen >= min_freq times, most frequent first (ties: by string).

        `spaces[k][i]` says whether token i of sentence k was followed by whitespace in the raw text;
        from it each kept word learns whether it usually glues to its left or right neighbour."""
        counts, glue_left, left_seen, glue_right, right_seen = Counter(), Counter(), Counter(), Counter(), Counter()
        sentences = [list(s) for s in sentences]
        spaces = [list(s) for s in spaces]
        for toks, sp in zip(sentences, spaces, strict=False):
            counts.update(toks)
            for i in range(1, len(toks)):
                if toks[i - 1] != QUOTE:  # a quote's side is decided by parity, so it says nothing about toks[i]
                    left_seen[toks[i]] += 1
                    glue_left[toks[i]] += not sp[i - 1]
        left = {t for t in left_seen if 2 * glue_left[t] > left_seen[t]}
        # Right-glue is only counted where the right neighbour is not itself a left-gluer, else every word
        # that often precedes "." would learn to glue to whatever follows it.
        for toks, sp in zip(sentences, spaces, strict=False):
            for i in range(len(toks) - 1):
                if toks[i + 1] not in left and toks[i + 1] != QUOTE:
                    right_seen[toks[i]] += 1
                    glue_right[toks[i]] += not sp[i]
        right = {t for t in right_seen if 2 * glue_right[t] > right_seen[t]}
        words = sorted((t for t, c in counts.items() if c >= min_freq and t not in SPECIALS),
                       key=lambda t: (-counts[t], t))
        if max_size is not None:
            words = words[:max(0, max_size - len(SPECIALS))]
        itos = SPECIALS + words
        flags = [0] * len(SPECIALS) + [NO_SPACE_BEFORE * (t in left) + NO_SPACE_AFTER * (t in right) for t in words]
        return cls(itos, flags)

    def encode(self, tokens: Sequence[str]) -> List[int]:
        return [self.stoi.get(t, UNK) for t in tokens]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Joins tokens with one space unless the left one glues right or the right one glues left.
        A straight double quote opens (glues right) on odd occurrences and closes (glues left) on even."""
        out, prev_glues_right, quotes = [], True, 0
        for i in ids:
            tok = self.itos[i]
            flag = self.flags[i]
            if tok == QUOTE:
                quotes += 1
                flag = NO_SPACE_AFTER if quotes % 2 else NO_SPACE_BEFORE
            if out and not prev_glues_right and not flag & NO_SPACE_BEFORE:
                out.append(" ")
            out.append(tok)
            prev_glues_right = bool(flag & NO_SPACE_AFTER)
        return "".join(out)


class SpacyTokenizer:
    """Rule-based spaCy tokenisation (`spacy.blank(lang)`, no model download), one vocabulary per language.

    Detokenisation: ids carry no whitespace, so each vocabulary word stores two flags learnt from the
    training text (whether it mostly follows its left neighbour without a space, e.g. "," "." "'s", and
    whether it mostly precedes its right neighbour without one, e.g. "(" "„"); tokens are joined with one
    space unless a flag says otherwise. Straight quotes alternate open/close. This reproduces nearly all
    Multi30k validation sentences exactly (benchmarks/bench_data.py measures it; docs/benchmarks/code-choices.md)."""

    name = "spacy"
    shared_vocab = False

    def __init__(self, src_lang: str, tgt_lang: str, src_vocab: Vocab, tgt_vocab: Vocab, lowercase: bool = False):
        self.src_lang, self.tgt_lang, self.lowercase = src_lang, tgt_lang, lowercase
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab

    @property
    def src_vocab_size(self) -> int:
        return len(self.src_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.tgt_vocab)

    def tokenize(self, texts: Sequence[str], lang: str, with_spaces: bool = False):
        """Token strings of each text (spaCy's whitespace tokens dropped); with `with_spaces`, also whether
        each token was followed by whitespace."""
        return spacy_tokenize(spacy_tokenizer(lang), texts, self.lowercase, with_spaces)

    @classmethod
    def train(cls, src_texts: Sequence[str], tgt_texts: Sequence[str], src_lang: str, tgt_lang: str,
              min_freq: int = 2, max_vocab: Optional[int] = None, lowercase: bool = False) -> "SpacyTokenizer":
        """Builds both vocabularies from the training split only; returns the tokenizer with
        `train_ids = (src_ids, tgt_ids)` of those texts attached, so they are tokenised just once."""
        tok = cls(src_lang, tgt_lang, Vocab(SPECIALS), Vocab(SPECIALS), lowercase)
        src_toks, src_sp = tok.tokenize(src_texts, src_lang, with_spaces=True)
        tgt_toks, tgt_sp = tok.tokenize(tgt_texts, tgt_lang, with_spaces=True)
        tok.src_vocab = Vocab.build(src_toks, src_sp, min_freq, max_vocab)
        tok.tgt_vocab = Vocab.build(tgt_toks, tgt_sp, min_freq, max_vocab)
        tok.train_ids = ([tok.src_vocab.encode(t) for t in src_toks], [tok.tgt_vocab.encode(t) for t in tgt_toks])
        return tok

    def encode_src(self, text: str) -> List[int]:
        return self.src_vocab.encode(self.tokenize([text], self.src_lang)[0])

    def encode_tgt(self, text: str) -> List[int]:
        return self.tgt_vocab.encode(self.tokenize([text], self.tgt_lang)[0])

    def encode_src_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.src_vocab.encode(t) for t in self.tokenize(texts, self.src_lang)]

    def encode_tgt_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tgt_vocab.encode(t) for t in self.tokenize(texts, self.tgt_lang)]

    def decode_src(self, ids: Iterable[int]) -> str:
        return self.src_vocab.detokenize(_strip_specials(ids))

    def decode_tgt(self, ids: Iterable[int]) -> str:
        return self.tgt_vocab.detokenize(_strip_specials(ids))

    def src_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.src_vocab.itos[int(i)] for i in ids]

    def tgt_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.tgt_vocab.itos[int(i)] for i in ids]

    def state_dict(self) -> dict:
        return {"name": self.name, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang, "lowercase": self.lowercase,
                "src_itos": list(self.src_vocab.itos), "src_flags": list(self.src_vocab.flags),
                "tgt_itos": list(self.tgt_vocab.itos), "tgt_flags": list(self.tgt_vocab.flags)}

    @classmethod
    def from_state(cls, state: dict) -> "SpacyTokenizer":
        return cls(state["src_lang"], state["tgt_lang"], Vocab(state["src_itos"], state["src_flags"]),
                   Vocab(state["tgt_itos"], state["tgt_flags"]), state.get("lowercase", False))

    def save(self, folder) -> None:
        """vocab.SRC.txt / vocab.TGT.txt (line k = token of id k, a tab, its detokeniser flags) and tokenizer.json."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for lang, vocab in ((self.src_lang, self.src_vocab), (self.tgt_lang, self.tgt_vocab)):
            lines = [f"{t}\t{_flag_name(f)}" for t, f in zip(vocab.itos, vocab.flags, strict=False)]
            write_text_atomic(folder / f"vocab.{lang}.txt", "\n".join(lines) + "\n")
        write_text_atomic(folder / "tokenizer.json", json.dumps(self.state_dict(), ensure_ascii=False) + "\n")


def _flag_name(flag: int) -> str:
    return {0: "-", NO_SPACE_BEFORE: "glue_left", NO_SPACE_AFTER: "glue_right"}.get(flag, "glue_both")


class BpeTokenizer:
    """One byte-pair-encoding vocabulary for both languages (Section 5.1 of the paper), HF `tokenizers`.

    Pre-tokenisation: Metaspace (spaces become "▁" attached to the next piece) then Punctuation
    splitting; the Metaspace decoder turns "▁" back into spaces, so decoding restores the original
    spacing exactly for characters seen in training (others become <unk> and are dropped)."""

    name = "bpe"
    shared_vocab = True

    def __init__(self, tok, src_lang: str = "", tgt_lang: str = "", n_tgt: Optional[int] = None):
        """`n_tgt`: the target side uses ids below it only (tokenizer.tgt_vocab=seen, `seen_targets_first`);
        None: the whole vocabulary."""
        self.tok, self.src_lang, self.tgt_lang = tok, src_lang, tgt_lang
        self.n_tgt = None if n_tgt is None or n_tgt >= tok.get_vocab_size() else int(n_tgt)
        for i, s in enumerate(SPECIALS):
            if tok.token_to_id(s) != i:
                raise ValueError(f"BPE vocabulary has {s} at id {tok.token_to_id(s)}, expected {i}")

    @classmethod
    def train(cls, texts: Iterable, vocab_size: int, min_freq: int = 2, lowercase: bool = False,
              src_lang: str = "", tgt_lang: str = "", length: Optional[int] = None) -> "BpeTokenizer":
        """`texts`: sentences, or lists of sentences, streamed (the trainer keeps word counts, not text)."""
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE(unk_token=SPECIALS[UNK]))
        if lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_freq, special_tokens=list(SPECIALS),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer, length=length if length is not None else len(texts))
        return cls(tok, src_lang, tgt_lang)

    def seen_targets_first(self, tgt_chunks: Iterable[Sequence[str]]) -> "BpeTokenizer":
        """The same segmentation with ids renumbered so that the types the training targets `tgt_chunks` (lists
        of sentences) use come first, after the specials: the target vocabulary is then ids below `n_tgt`,
        and the output layer computes that many logits instead of one per shared type. A shared German-English
        BPE spends many types on one side only (Multi30k, 8,000: 4,245 occur in the English training side)."""
        from tokenizers import Tokenizer
        V = self.tok.get_vocab_size()
        seen = np.zeros(V, dtype=bool)
        seen[:len(SPECIALS)] = True
        for texts in tgt_chunks:
            for e in self.tok.encode_batch(list(texts), add_special_tokens=False):
                seen[e.ids] = True
        order = np.concatenate([np.nonzero(seen)[0], np.nonzero(~seen)[0]])  # new id -> old id
        state = json.loads(self.tok.to_str())
        old_to_new = np.empty(V, dtype=np.int64)
        old_to_new[order] = np.arange(V)
        state["model"]["vocab"] = {t: int(old_to_new[i]) for t, i in state["model"]["vocab"].items()}
        return BpeTokenizer(Tokenizer.from_str(json.dumps(state, ensure_ascii=False)), self.src_lang, self.tgt_lang,
                            int(seen.sum()))

    @property
    def src_vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.n_tgt or self.tok.get_vocab_size()

    def encode_src_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_tgt_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self._target_ids(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_src(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_tgt(self, text: str) -> List[int]:
        return self._target_ids(self.tok.encode(text, add_special_tokens=False).ids)

    def _target_ids(self, ids: List[int]) -> List[int]:
        """A type no training target used (a held-out reference only) is <unk> on the target side."""
        n = self.n_tgt
        return ids if n is None else [i if i < n else UNK for i in ids]

    def decode_tgt(self, ids: Iterable[int]) -> str:
        return self.tok.decode(_strip_specials(ids), skip_special_tokens=True)

    decode_src = decode_tgt

    def tgt_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.tok.id_to_token(int(i)) for i in ids]

    src_tokens = tgt_tokens

    def state_dict(self) -> dict:
        state = {"name": self.name, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang, "json": self.tok.to_str()}
        # Only when set: a full vocabulary's state stays what earlier versions wrote (averaging compares states).
        return state if self.n_tgt is None else {**state, "n_tgt": self.n_tgt}

    @classmethod
    def from_state(cls, state: dict) -> "BpeTokenizer":
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_str(state["json"]), state.get("src_lang", ""), state.get("tgt_lang", ""),
                   state.get("n_tgt"))

    def save(self, folder) -> None:
        """tokenizer.json (Hugging Face format, loadable with `tokenizers.Tokenizer.from_file`) and vocab.txt."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / "tokenizer.json", self.tok.to_str(pretty=True) + "\n")
        itos = [self.tok.id_to_token(i) for i in range(self.tok.get_vocab_size())]
        write_text_atomic(folder / "vocab.txt", "\n".join(itos) + "\n")


def train_tokenizer(cfg_tok, src_lang: str, tgt_lang: str, src_texts: Sequence[str], tgt_texts: Sequence[str],
                    seed: int = 0):
    """Trains the tokenizer `cfg_tok` (the `tokenizer` config group) on the training split only, held in
    memory (preprocessing streams instead: transformer/data/preprocess.py)."""
    check_tokenizer_config(cfg_tok)
    if cfg_tok.name == "spacy":
        return SpacyTokenizer.train(src_texts, tgt_texts, src_lang, tgt_lang, cfg_tok.min_freq, cfg_tok.max_vocab,
                                    cfg_tok.lowercase)
    if cfg_tok.name == "sentencepiece":
        from transformer.data import spm
        tok = spm.build(cfg_tok, src_lang, tgt_lang, [list(src_texts), list(tgt_texts)], seed)
        return tok.seen_targets_first([tgt_texts]) if cfg_tok.tgt_vocab == "seen" else tok
    tok = BpeTokenizer.train(list(src_texts) + list(tgt_texts), cfg_tok.vocab_size, max(cfg_tok.min_freq, 0),
                             cfg_tok.lowercase, src_lang, tgt_lang)
    return tok.seen_targets_first([tgt_texts]) if cfg_tok.tgt_vocab == "seen" else tok


def check_tokenizer_config(cfg_tok) -> None:
    """Values of the `tokenizer` group a type cannot rule out; the error names the key."""
    if cfg_tok.name not in ("spacy", "bpe", "sentencepiece"):
        raise ValueError(f"tokenizer.name={cfg_tok.name!r}: must be spacy, bpe or sentencepiece")
    if cfg_tok.name == "spacy" and cfg_tok.min_freq < 1:
        raise ValueError(f"tokenizer.min_freq={cfg_tok.min_freq}: must be >= 1")
    if cfg_tok.tgt_vocab not in ("full", "seen"):
        raise ValueError(f"tokenizer.tgt_vocab={cfg_tok.tgt_vocab!r}: must be full or seen")
    if cfg_tok.tgt_vocab == "seen" and cfg_tok.name == "spacy":
        raise ValueError("tokenizer.tgt_vocab=seen: needs tokenizer=bpe or sentencepiece (spaCy's target "
                         "vocabulary is its own)")
    if cfg_tok.name == "sentencepiece":
        from transformer.data.spm import check_config
        check_config(cfg_tok)
    if cfg_tok.name != "spacy" and cfg_tok.vocab_size <= len(SPECIALS):
        raise ValueError(f"tokenizer.vocab_size={cfg_tok.vocab_size}: must exceed the {len(SPECIALS)} specials")
    if cfg_tok.train_sample is not None and cfg_tok.train_sample < 1:
        raise ValueError(f"tokenizer.train_sample={cfg_tok.train_sample}: must be >= 1 or null (all sentences)")


def tokenizer_from_state(state: dict):
    """Rebuilds a tokenizer from its `state_dict()` (e.g. the one stored in a checkpoint)."""
    name = state.get("name")
    if name == "spacy":
        return SpacyTokenizer.from_state(state)
    if name == "bpe":
        return BpeTokenizer.from_state(state)
    if name == "sentencepiece":
        from transformer.data.spm import SentencePieceTokenizer
        return SentencePieceTokenizer.from_state(state)
    if name == "sentencepiece_pair":
        from transformer.data.spm_pair import SentencePiecePairTokenizer
        return SentencePiecePairTokenizer.from_state(state)
    if name == "copy":
        from transformer.data.copy import CopyTokenizer
        return CopyTokenizer(int(state["vocab_size"]))
    raise ValueError(f"unknown tokenizer state name={name!r}: expected spacy, bpe, sentencepiece, "
                     "sentencepiece_pair or copy")


def encode_sources(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Ids (no specials) of raw source sentences, batched where the tokenizer can."""
    batch = getattr(tokenizer, "encode_src_batch", None)
    return batch(list(texts)) if batch else [tokenizer.encode_src(t) for t in texts]
