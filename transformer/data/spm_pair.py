"""Two SentencePiece models, one per side, over one shared vocabulary: the tokenizer of released OPUS-MT
(Hugging Face `MarianTokenizer`) models, as this project imports them (transformer/interop/opus.py).

Marian segments the source with `source.spm` and the target with `target.spm` into piece strings, then looks
each piece up in `vocab.json` (a piece it lacks is <unk>): the SentencePiece models' own ids are not used.
Here the vocabulary is a list of pieces in this project's id order (the specials at 0..3,
transformer/specials.py), and encoding does what `MarianTokenizer` does, so the same text gives the same
pieces: a special token's text (such as `</s>`) is kept whole and never segmented, and a leading language code
`>>xx<<` is one token. The models travel in `state_dict()` as base64 text (primitives only), so a checkpoint
alone rebuilds the tokenizer. No torch here: preprocessing worker processes import this module.
"""
import base64
import re
from typing import Dict, Iterable, List, Sequence

from transformer.specials import SPECIAL_IDS, SPECIALS, UNK, until_eos

NAME = "sentencepiece_pair"
SIDES = ("src", "tgt")


def _processor(proto: bytes):
    import sentencepiece
    return sentencepiece.SentencePieceProcessor(model_proto=proto)


def _language_code(text: str):
    """MarianTokenizer.remove_language_code: ([">>xx<<"], rest) when the text starts with one, else ([], text)."""
    end = text.find("<<") if text.startswith(">>") else -1
    return ([text[:end + 2]], text[end + 2:]) if end != -1 else ([], text)


class SentencePiecePairTokenizer:
    """The `tokenizer` interface of transformer/data/tokenizer.py over a source and a target SentencePiece model
    and one vocabulary (`pieces`: id k's string, `SPECIALS` first)."""

    name = NAME
    shared_vocab = True

    def __init__(self, src_model: bytes, tgt_model: bytes, pieces: Sequence[str], text_specials: Dict[str, int],
                 src_lang: str = "", tgt_lang: str = ""):
        """`text_specials`: the strings kept whole in a text (Marian's special tokens) and the id each becomes."""
        self.src_model, self.tgt_model = bytes(src_model), bytes(tgt_model)
        self.pieces, self.text_specials = list(pieces), dict(text_specials)
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        if self.pieces[:len(SPECIALS)] != SPECIALS:
            raise ValueError(f"a sentencepiece_pair vocabulary starts with {SPECIALS}, not {self.pieces[:4]}")
        if len(set(self.pieces)) != len(self.pieces):
            raise ValueError("a sentencepiece_pair vocabulary has a piece twice")
        if any(not 0 <= i < len(self.pieces) for i in self.text_specials.values()):
            raise ValueError("a sentencepiece_pair special token has an id outside the vocabulary")
        self.sp = {"src": _processor(self.src_model), "tgt": _processor(self.tgt_model)}
        self.index = {p: i for i, p in enumerate(self.pieces)}
        self.index.update({p: UNK for p in SPECIALS if p not in self.text_specials})  # never a text's piece
        self.index.update(self.text_specials)
        strings = sorted(self.text_specials, key=len, reverse=True)  # the longest match first, as a trie splits
        self._split = re.compile("(" + "|".join(map(re.escape, strings)) + ")") if strings else None

    @property
    def src_vocab_size(self) -> int:
        return len(self.pieces)

    tgt_vocab_size = src_vocab_size

    def segment(self, text: str, side: str) -> List[str]:
        """The piece strings of `text` on `side` ("src" or "tgt"), as MarianTokenizer.tokenize gives them."""
        out = []
        for chunk in self._split.split(text) if self._split else [text]:
            if not chunk:
                continue
            if chunk in self.text_specials:
                out.append(chunk)
                continue
            code, rest = _language_code(chunk)
            out += code + self.sp[side].encode(rest, out_type=str)
        return out

    def encode(self, texts: Sequence[str], side: str) -> List[List[int]]:
        index = self.index
        return [[index.get(p, UNK) for p in self.segment(t, side)] for t in texts]

    def encode_src_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.encode(texts, "src")

    def encode_tgt_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.encode(texts, "tgt")

    def encode_src(self, text: str) -> List[int]:
        return self.encode([text], "src")[0]

    def encode_tgt(self, text: str) -> List[int]:
        return self.encode([text], "tgt")[0]

    def _decode(self, ids: Iterable[int], side: str) -> str:
        """Up to the first </s>, specials and <unk> dropped; the pieces joined by the side's model, as
        MarianTokenizer.decode(skip_special_tokens=True) joins them."""
        pieces = [self.pieces[i] for i in until_eos(ids, SPECIAL_IDS)]
        return self.sp[side].decode_pieces(pieces).replace("\u2581", " ").strip()

    def decode_tgt(self, ids: Iterable[int]) -> str:
        return self._decode(ids, "tgt")

    def decode_src(self, ids: Iterable[int]) -> str:
        return self._decode(ids, "src")

    def tgt_tokens(self, ids: Iterable[int]) -> List[str]:
        return [self.pieces[int(i)] for i in ids]

    src_tokens = tgt_tokens

    def state_dict(self) -> dict:
        return {"name": self.name, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang,
                "src_model": base64.b64encode(self.src_model).decode("ascii"),
                "tgt_model": base64.b64encode(self.tgt_model).decode("ascii"),
                "pieces": list(self.pieces), "text_specials": dict(self.text_specials)}

    @classmethod
    def from_state(cls, state: dict) -> "SentencePiecePairTokenizer":
        return cls(base64.b64decode(state["src_model"]), base64.b64decode(state["tgt_model"]), state["pieces"],
                   state["text_specials"], state.get("src_lang", ""), state.get("tgt_lang", ""))

    def save(self, folder) -> None:
        """source.spm and target.spm (the SentencePiece models) and vocab.txt (line k: piece k)."""
        from pathlib import Path

        from transformer.atomic import atomic_open, write_text_atomic
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, proto in (("source.spm", self.src_model), ("target.spm", self.tgt_model)):
            with atomic_open(folder / name) as f:
                f.write(proto)
        write_text_atomic(folder / "vocab.txt", "\n".join(self.pieces) + "\n")


_LOADED: Dict[str, SentencePiecePairTokenizer] = {}


def encode_chunk(state_file: str, side: str, texts: Sequence[str]) -> List[List[int]]:
    """Preprocessing's kernel (transformer/data/encode.py): the ids of `texts` on `side` under the tokenizer
    whose state (JSON) is in `state_file`, loaded once per process."""
    if state_file not in _LOADED:
        import json
        from pathlib import Path
        _LOADED[state_file] = SentencePiecePairTokenizer.from_state(json.loads(Path(state_file).read_text("utf-8")))
    return _LOADED[state_file].encode(texts, side)
