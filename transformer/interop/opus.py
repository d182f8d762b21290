"""Released OPUS-MT models: Hugging Face MarianMTModel folders with a SentencePiece `MarianTokenizer`
(`source.spm`, `target.spm`, `vocab.json`, `tokenizer_config.json`) instead of a `tokenizer.json`.

Their vocabulary is in Marian's order: `</s>`=0, `<unk>`=1, the pieces, `<pad>` last, and no `<s>`: the
decoder starts from `<pad>` (config.json's decoder_start_token_id = pad_token_id), whose embedding row is the
start vector (zeros in the converted Marian models). This project fixes `<pad> <unk> <s> </s>` at ids 0..3, so
the import renumbers the vocabulary, and with it the rows of the embeddings, the output layer and
final_logits_bias:
- the decoder-start row becomes `<s>`'s row: the decoder starts from the same vector;
- `</s>` and `<unk>` map to ours, every other piece keeps its vector, in Marian's order after the specials;
- when the start token is `<pad>` (OPUS-MT), `<pad>` gets a new row (zeros, as this project's padding row).
Marian never outputs `<pad>` (its generation config bans it, and `renormalize_logits` takes it out of the
softmax), and the original Marian model has no such row at all. Here `<pad>` and `<s>` are never output
either, but they are output rows of the softmax: their bias is set to `NEVER`, so that each gets a
probability of exactly zero (exp underflows) and the log-probabilities equal Marian's over its real pieces.
"""
import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from transformer.interop import InteropError
from transformer.specials import BOS, EOS, PAD, SPECIALS, UNK

# The output bias of rows never scored (<pad>, and <s> when it is Marian's <pad>): exp(NEVER - max) is 0 in
# float32 and float64 whatever the other logits, and it stays finite, so the training loss stays finite.
NEVER = -1000.0
VOCAB_WEIGHTS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                 "lm_head.weight")


def is_sentencepiece_folder(path: Path) -> bool:
    """A Marian folder whose tokenizer is MarianTokenizer's files rather than a tokenizer.json."""
    files = [(path / name).is_file() for name in ("vocab.json", "source.spm", "tokenizer.json")]
    return files == [True, True, False]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InteropError(f"{path}: unreadable ({e})") from None


def _content(token, default: str) -> str:
    """A tokenizer_config.json token: a string, or an AddedToken written as a dict."""
    if token is None:
        return default
    return token.get("content", default) if isinstance(token, dict) else str(token)


def read_vocabulary(path: Path, cfg: dict) -> Tuple[dict, List[int], List[int]]:
    """(tokenizer state, rows, never): the `sentencepiece_pair` tokenizer state of the folder, Marian's row of
    each of our ids (-1: a new row), and our ids whose output is never scored."""
    from transformer.data.spm_pair import SentencePiecePairTokenizer

    tcfg = _json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    if tcfg.get("separate_vocabs"):
        raise InteropError(f"{path}: tokenizer_config.json separate_vocabs=true (a target_vocab.json): only one "
                           "vocabulary for both sides is imported")
    vocab = _json(path / "vocab.json")
    V = int(cfg["vocab_size"])
    if sorted(vocab.values()) != list(range(V)) or cfg.get("decoder_vocab_size", V) not in (None, V):
        raise InteropError(f"{path}: vocab.json does not number config.json's vocab_size={V} pieces 0..{V - 1} "
                           f"(decoder_vocab_size={cfg.get('decoder_vocab_size')})")
    piece = {i: p for p, i in vocab.items()}
    eos, unk, pad = (_content(tcfg.get(f"{k}_token"), default)
                     for k, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>")))
    ids = {"eos_token_id": eos, "pad_token_id": pad}
    for key, token in ids.items():
        if vocab.get(token) != cfg.get(key):
            raise InteropError(f"{path}: config.json {key}={cfg.get(key)}, but vocab.json has {token} at "
                               f"{vocab.get(token)}")
    if unk not in vocab:
        raise InteropError(f"{path}: vocab.json has no {unk} (the unknown piece)")
    start = cfg.get("decoder_start_token_id")
    if start is None or not 0 <= start < V:
        raise InteropError(f"{path}: config.json decoder_start_token_id={start} is not a vocabulary id")
    specials = [vocab[pad] if start != vocab[pad] else -1, vocab[unk], start, vocab[eos]]
    if len(set(specials)) != 4:
        raise InteropError(f"{path}: <unk>, </s> and the decoder start are not three different ids")
    rest = [i for i in range(V) if i not in specials]
    clash = [piece[i] for i in rest if piece[i] in SPECIALS]
    if clash:
        raise InteropError(f"{path}: vocab.json has {clash[0]!r} as an ordinary piece; this project reserves it")
    rows = specials + rest
    ours = {m: k for k, m in enumerate(rows) if m >= 0}
    text_specials = {eos: EOS, unk: UNK, pad: ours[vocab[pad]]}
    for token in (tcfg.get("added_tokens_decoder") or {}).values():
        s = _content(token, "")
        if s and s not in text_specials:
            if s not in vocab:
                raise InteropError(f"{path}: added token {s!r} is not in vocab.json")
            text_specials[s] = ours[vocab[s]]
    try:
        src, tgt = ((path / f).read_bytes() for f in ("source.spm", "target.spm"))
        tok = SentencePiecePairTokenizer(src, tgt, SPECIALS + [piece[i] for i in rest], text_specials,
                                         tcfg.get("source_lang") or "", tcfg.get("target_lang") or "")
    except (OSError, RuntimeError, ValueError) as e:
        raise InteropError(f"{path}: source.spm/target.spm do not load ({str(e).strip() or type(e).__name__})") \
            from None
    return tok.state_dict(), rows, [PAD, BOS] if start == vocab[pad] else []


def eval_settings(path: Path, cfg: dict) -> dict:
    """The `eval` settings of the folder's generation defaults (generation_config.json, or config.json in older
    uploads): its beam size and length penalty, which rank hypotheses as eval.lenpen does (logprob / length)."""
    gen = _json(path / "generation_config.json") if (path / "generation_config.json").is_file() else cfg
    out = {}
    if int(gen.get("num_beams") or 1) > 1:
        out["beam"] = int(gen["num_beams"])
    if gen.get("length_penalty") is not None:
        out["lenpen"] = float(gen["length_penalty"])
    return out


def remap_rows(hf_state: Dict[str, torch.Tensor], rows: List[int], never: List[int]) -> Dict[str, torch.Tensor]:
    """Marian's state dict with its vocabulary-indexed tensors in our id order (`read_vocabulary`): row k is
    Marian's row rows[k], zeros where that is -1; the output bias of `never` is NEVER."""
    index = torch.tensor(rows)
    known = index >= 0
    out = dict(hf_state)
    for key in VOCAB_WEIGHTS:
        if key in hf_state:
            t = hf_state[key]
            new = t.new_zeros((len(rows), *t.shape[1:]))
            new[known] = t[index[known]]
            out[key] = new
    bias = hf_state["final_logits_bias"]  # (1, V)
    new = bias.new_zeros((bias.size(0), len(rows)))
    new[:, known] = bias[:, index[known]]
    new[:, never] = NEVER
    out["final_logits_bias"] = new
    return out


def write_marian_tokenizer(tokenizer, folder: Path, max_positions: int) -> None:
    """A `sentencepiece_pair` tokenizer as MarianTokenizer's files in `folder`, numbered as this project numbers
    them (<pad> <unk> <s> </s> first; the export's config.json says so): `transformers` then gives the same ids."""
    from transformers import MarianTokenizer

    (folder / "source.spm").write_bytes(tokenizer.src_model)
    (folder / "target.spm").write_bytes(tokenizer.tgt_model)
    vocab = {p: i for i, p in enumerate(tokenizer.pieces)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"),
                    source_lang=tokenizer.src_lang or None, target_lang=tokenizer.tgt_lang or None,
                    model_max_length=max_positions).save_pretrained(folder)
