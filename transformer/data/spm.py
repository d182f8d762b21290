"""SentencePiece (`tokenizer=sentencepiece`): one unigram or BPE vocabulary shared by both languages, learnt from
the training split, or read from an existing `.model` file (`tokenizer.model_file`).

Every model this project uses has the specials <pad> <unk> <s> </s> at ids 0..3 (transformer/specials.py).
A trained one is made that way; a given file whose specials sit elsewhere (sentencepiece's own default is
<unk> <s> </s> at 0..2 and no <pad>) is renumbered: the specials move to 0..3 (added as control pieces where
missing) and every other piece keeps its order, string and score, so text segments into the same pieces.
The serialized model proto travels in `state_dict()` as base64 text (checkpoints load with
`weights_only=True`, preprocessed manifests are JSON), so a checkpoint alone rebuilds the tokenizer.
"""
import base64
import hashlib
import io
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np

from transformer.atomic import atomic_open, write_text_atomic
from transformer.specials import SPECIAL_IDS, SPECIALS, UNK, until_eos

MODEL_TYPES = ("unigram", "bpe")
MODEL_FILE = "sentencepiece.model"  # the name `save` writes the model under in a run directory
# ids 0..3 of the specials, named as sentencepiece's trainer_spec names them
SPECIAL_KEYS = ("pad", "unk", "bos", "eos")


def _spm():
    try:
        import sentencepiece
    except ImportError:  # an install_requires dependency: only a broken environment lacks it
        raise ValueError("tokenizer.name=sentencepiece needs the sentencepiece package: pip install sentencepiece") \
            from None
    return sentencepiece


def _pb():
    from sentencepiece import sentencepiece_model_pb2
    return sentencepiece_model_pb2


def _flatten(texts: Iterable) -> Iterable[str]:
    """Sentences from a stream of sentences or of lists of sentences (chunks), as BPE training takes them."""
    for t in texts:
        if isinstance(t, str):
            yield t
        else:
            yield from t


def _renumber(proto: bytes, where: str, order: Optional[Sequence[int]] = None) -> bytes:
    """The model with its specials at ids 0..3 under this project's strings, then its other pieces in their
    order (or in `order`, a permutation of the other pieces' old ids). `where` names the model in errors."""
    pb = _pb()
    m = pb.ModelProto()
    m.ParseFromString(proto)
    spec, P = m.trainer_spec, pb.ModelProto.SentencePiece
    index = {p.piece: i for i, p in enumerate(m.pieces)}
    special_ids = []
    for key, want, kind in zip(SPECIAL_KEYS, SPECIALS, (P.CONTROL, P.UNKNOWN, P.CONTROL, P.CONTROL), strict=True):
        i = next((i for i, p in enumerate(m.pieces) if p.type == P.UNKNOWN), -1) if key == "unk" else \
            index.get(getattr(spec, f"{key}_piece") or want, -1)
        if i >= 0 and m.pieces[i].type != kind:
            i = -1  # e.g. a normal piece spelled "<s>": not the model's sentence marker
        special_ids.append(i)
        clash = index.get(want, -1)
        if clash >= 0 and clash != i:
            raise ValueError(f"{where}: piece {want!r} (id {clash}) is not the model's {key} symbol, and this "
                             f"project reserves {want!r} for it")
    if special_ids[1] < 0:
        raise ValueError(f"{where}: the model has no unknown piece")
    already = all(m.pieces[k].piece == want and getattr(spec, f"{key}_id") == k and getattr(spec, f"{key}_piece")
                  in ("", want) for k, (key, want) in enumerate(zip(SPECIAL_KEYS, SPECIALS, strict=True)))
    if already and order is None and special_ids == [0, 1, 2, 3]:
        return proto
    rest = [i for i in range(len(m.pieces)) if i not in special_ids]
    if order is not None:
        if sorted(order) != rest:
            raise ValueError(f"{where}: a renumbering must list every non-special piece once")
        rest = list(order)
    pieces = []
    for i, want, kind in zip(special_ids, SPECIALS, (P.CONTROL, P.UNKNOWN, P.CONTROL, P.CONTROL), strict=True):
        p = P()
        if i >= 0:
            p.CopyFrom(m.pieces[i])
        p.piece, p.type = want, kind
        pieces.append(p)
    pieces += [m.pieces[i] for i in rest]
    out = pb.ModelProto()
    out.CopyFrom(m)
    del out.pieces[:]
    out.pieces.extend(pieces)
    for k, (key, want) in enumerate(zip(SPECIAL_KEYS, SPECIALS, strict=True)):
        setattr(out.trainer_spec, f"{key}_id", k)
        setattr(out.trainer_spec, f"{key}_piece", want)
    return out.SerializeToString(deterministic=True)


class SentencePieceTokenizer:
    """The `tokenizer` interface of transformer/data/tokenizer.py over a `SentencePieceProcessor`."""

    name = "sentencepiece"
    shared_vocab = True

    def __init__(self, proto: bytes, src_lang: str = "", tgt_lang: str = "", n_tgt: Optional[int] = None):
        """`proto`: a serialized model with the specials at 0..3; `n_tgt` as for `BpeTokenizer` (tgt_vocab=seen)."""
        self.proto, self.src_lang, self.tgt_lang = bytes(proto), src_lang, tgt_lang
        self.sp = _spm().SentencePieceProcessor(model_proto=self.proto)
        got = [self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()]
        if got != [0, 1, 2, 3] or [self.sp.id_to_piece(i) for i in range(4)] != SPECIALS:
            raise ValueError(f"sentencepiece model has pad/unk/bos/eos at ids {got}, expected 0..3 as {SPECIALS}")
        V = self.sp.get_piece_size()
        self.n_tgt = None if n_tgt is None or n_tgt >= V else int(n_tgt)

    @classmethod
    def train(cls, texts: Iterable, vocab_size: int, model_type: str = "unigram", lowercase: bool = False,
              character_coverage: float = 1.0, byte_fallback: bool = False, seed: int = 0, threads: int = 4,
              src_lang: str = "", tgt_lang: str = "") -> "SentencePieceTokenizer":
        """`texts`: every sentence to learn from (sentences or chunks of them, streamed once; the caller samples
        them, so sentencepiece's own sampling is off). The model's bytes depend on the sentences and all the
        arguments, `threads` included (the unigram trainer splits its work by thread), not on the machine."""
        spm = _spm()
        spm.set_random_generator_seed(seed)
        out = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(_flatten(texts)), model_writer=out, vocab_size=vocab_size,
                model_type=model_type, character_coverage=character_coverage, byte_fallback=byte_fallback,
                normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc", num_threads=threads,
                input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
                **{f"{k}_id": i for i, k in enumerate(SPECIAL_KEYS)},
                **{f"{k}_piece": s for k, s in zip(SPECIAL_KEYS, SPECIALS, strict=True)})
        except RuntimeError as e:  # e.g. "Vocabulary size is too big. Please set it to a value <= 731."
            first = str(e).strip().splitlines()[-1].split("] ")[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"tokenizer.vocab_size={vocab_size}: sentencepiece cannot train ({first})") from None
        return cls(out.getvalue(), src_lang, tgt_lang)

    @classmethod
    def from_model_file(cls, path, src_lang: str = "", tgt_lang: str = "") -> "SentencePieceTokenizer":
        """An existing `.model` file (renumbered if its specials are not at 0..3, see the module docstring)."""
        path = Path(path).expanduser()
        where = f"tokenizer.model_file={path}"
        try:
            proto = path.read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
        try:
            _spm().SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{where}: not a sentencepiece model ({str(e).strip() or type(e).__name__})") from None
        return cls(_renumber(proto, where), src_lang, tgt_lang)

    def seen_targets_first(self, tgt_chunks: Iterable[Sequence[str]]) -> "SentencePieceTokenizer":
        """The same segmentation with the pieces the training targets use numbered first, after the specials
        (tokenizer.tgt_vocab=seen; see `BpeTokenizer.seen_targets_first`)."""
        V = self.sp.get_piece_size()
        seen = np.zeros(V, dtype=bool)
        seen[:len(SPECIALS)] = True
        for texts in tgt_chunks:
            for ids in self.sp.encode(list(texts), out_type=int):
                seen[ids] = True
        order = np.concatenate([np.nonzero(seen[4:])[0], np.nonzero(~seen[4:])[0]]) + len(SPECIALS)
        return SentencePieceTokenizer(_renumber(self.proto, "sentencepiece model", order.tolist()), self.src_lang,
                                      self.tgt_lang, int(seen.sum()))

    @property
    def model_type(self) -> str:
        pb = _pb()
        m = pb.ModelProto()
        m.ParseFromString(self.proto)
        return pb.TrainerSpec.ModelType.Name(m.trainer_spec.model_type).lower()

    @property
    def src_vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.n_tgt or self.sp.get_piece_size()

    def encode_src_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def encode_tgt_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self._target_ids(ids) for ids in self.sp.encode(list(texts), out_type=int)]

    def encode_src(self, text: str) -> List[int]:
        return self.sp.encode(text, out_type=int)

    def encode_tgt(self, text: str) -> List[int]:
        return self._target_ids(self.sp.encode(text, out_type=int))

    def _target_ids(self, ids: List[int]) -> List[int]:
        n = self.n_tgt
        return ids if n is None else [i if i < n else UNK for i in ids]

    def decode_tgt(self, ids: Iterable[int]) -> str:
        """Up to the first </s>; specials and <unk> are dropped (as the BPE tokenizer drops them)."""
        return self.sp.decode(until_eos(ids, SPECIAL_IDS))

    decode_src = decode_tgt

    def tgt_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    src_tokens = tgt_tokens

    def state_dict(self) -> dict:
        """Primitives only. `model` is the serialized ModelProto in base64: with it alone, a Hugging Face export
        can build its tokenizer (transformers' sentencepiece converters read the same proto)."""
        state = {"name": self.name, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang,
                 "model_type": self.model_type, "model": base64.b64encode(self.proto).decode("ascii"),
                 "specials": list(SPECIALS)}
        return state if self.n_tgt is None else {**state, "n_tgt": self.n_tgt}

    @classmethod
    def from_state(cls, state: dict) -> "SentencePieceTokenizer":
        return cls(base64.b64decode(state["model"]), state.get("src_lang", ""), state.get("tgt_lang", ""),
                   state.get("n_tgt"))

    def save(self, folder) -> None:
        """sentencepiece.model (loadable with `SentencePieceProcessor(model_file=...)`, ids as in training)
        and vocab.txt (line k: piece k, a tab, its score)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_open(folder / MODEL_FILE) as f:
            f.write(self.proto)
        lines = [f"{self.sp.id_to_piece(i)}\t{self.sp.get_score(i):g}" for i in range(self.sp.get_piece_size())]
        write_text_atomic(folder / "vocab.txt", "\n".join(lines) + "\n")


def check_config(t) -> None:
    """Values of the `tokenizer` group (name=sentencepiece) a type cannot rule out; the error names the key."""
    if t.model_type not in MODEL_TYPES:
        raise ValueError(f"tokenizer.model_type={t.model_type!r}: must be {' or '.join(MODEL_TYPES)}")
    if not 0 < t.character_coverage <= 1:
        raise ValueError(f"tokenizer.character_coverage={t.character_coverage}: must be in (0, 1]")
    if t.train_threads < 1:
        raise ValueError(f"tokenizer.train_threads={t.train_threads}: must be >= 1")
    if t.model_file is not None and not Path(t.model_file).expanduser().is_file():
        raise ValueError(f"tokenizer.model_file={t.model_file}: cannot read it (no such file)")
    if t.model_file is not None and t.lowercase:
        raise ValueError("tokenizer.lowercase=true: a given tokenizer.model_file normalises text its own way")


def model_file_digest(path) -> str:
    """sha256 of the given `.model` (part of the preprocessing cache key)."""
    path = Path(path).expanduser()
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ValueError(f"tokenizer.model_file={path}: cannot read it ({e.strerror or e})") from None


def cache_key_parts(t, seed: int) -> dict:
    """What in the `tokenizer` group (name=sentencepiece) changes the ids."""
    from importlib import metadata
    parts = {"name": t.name, "lowercase": t.lowercase, "lib": metadata.version("sentencepiece")}
    if t.model_file is not None:
        parts["model_file_sha256"] = model_file_digest(t.model_file)
    else:
        parts.update(vocab_size=t.vocab_size, model_type=t.model_type, character_coverage=t.character_coverage,
                     byte_fallback=t.byte_fallback, train_sample=t.train_sample, train_threads=t.train_threads,
                     seed=seed)
    if t.tgt_vocab != "full":
        parts["tgt_vocab"] = t.tgt_vocab
    return parts


def build(cfg_tok, src_lang: str, tgt_lang: str, texts: Optional[Iterable] = None, seed: int = 0):
    """The tokenizer of `cfg_tok`: read from tokenizer.model_file, or trained on `texts` (the training sample)."""
    check_config(cfg_tok)
    if cfg_tok.model_file is not None:
        return SentencePieceTokenizer.from_model_file(cfg_tok.model_file, src_lang, tgt_lang)
    return SentencePieceTokenizer.train(texts, cfg_tok.vocab_size, cfg_tok.model_type, cfg_tok.lowercase,
                                        cfg_tok.character_coverage, cfg_tok.byte_fallback, seed,
                                        cfg_tok.train_threads, src_lang, tgt_lang)
