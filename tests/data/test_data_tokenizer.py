"""spaCy word vocabularies and shared BPE: special ids, train-only vocabularies, round trips, state dicts."""
import io
import json

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.data import TRAIN_DE, TRAIN_EN
from transformer.data.batch import BOS, EOS, PAD, SPECIALS, UNK
from transformer.data.config import TokenizerConfig
from transformer.data.tokenizer import (
    BpeTokenizer,
    SpacyTokenizer,
    Vocab,
    encode_sources,
    tokenizer_from_state,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def spacy_tok():
    return SpacyTokenizer.train(TRAIN_DE, TRAIN_EN, "de", "en", min_freq=1)


@pytest.fixture(scope="module")
def bpe_tok():
    return BpeTokenizer.train(TRAIN_DE + TRAIN_EN, vocab_size=150, min_freq=1, src_lang="de", tgt_lang="en")


def _reload(state: dict) -> dict:
    """What a checkpoint gives back: torch.save then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save({"tokenizer": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["tokenizer"]


def test_spacy_specials_and_order(spacy_tok):
    for vocab in (spacy_tok.src_vocab, spacy_tok.tgt_vocab):
        assert vocab.itos[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
        assert [vocab.stoi[s] for s in SPECIALS] == [PAD, UNK, BOS, EOS]
    itos = spacy_tok.tgt_vocab.itos[4:]
    counts = {t: sum(s.count(t) for s in spacy_tok.tokenize(TRAIN_EN, "en")) for t in itos}
    assert itos == sorted(itos, key=lambda t: (-counts[t], t))  # frequency, then the token, decides the order
    assert itos[:3] == [".", "A", "a"]  # 8, 6 and 6 times: the tie is broken by the string


def test_spacy_vocabulary_comes_from_train_only():
    tok = SpacyTokenizer.train(TRAIN_DE, TRAIN_EN, "de", "en", min_freq=1)
    assert "Zebra" not in tok.tgt_vocab.stoi
    ids = tok.encode_tgt("A Zebra reads a book.")
    assert ids[1] == UNK and ids.count(UNK) == 1
    assert tok.src_vocab_size != tok.tgt_vocab_size and not tok.shared_vocab
    assert "Hund" in tok.src_vocab.stoi and "Hund" not in tok.tgt_vocab.stoi  # one vocabulary per language


def test_spacy_min_freq_and_max_vocab():
    tok = SpacyTokenizer.train(TRAIN_DE, TRAIN_EN, "de", "en", min_freq=2)
    assert "soccer" not in tok.tgt_vocab.stoi and "park" in tok.tgt_vocab.stoi  # seen once / three times
    assert tok.encode_tgt("soccer") == [UNK]
    small = SpacyTokenizer.train(TRAIN_DE, TRAIN_EN, "de", "en", min_freq=1, max_vocab=10)
    assert small.src_vocab_size == small.tgt_vocab_size == 10


@pytest.mark.parametrize("text", ["A man reads a book in the park.", "Two dogs, a man and a woman play.",
                                  "A (dog) runs.", 'A man reads "a book."', "A dog's bike."])
def test_spacy_round_trip(text):
    train = TRAIN_EN + ["Two dogs, a man and a woman play.", "A (dog) runs.", 'A man reads "a book."',
                        "A dog's bike."]
    tok = SpacyTokenizer.train(train, train, "en", "en", min_freq=1)
    ids = tok.encode_tgt(text)
    assert UNK not in ids and PAD not in ids and EOS not in ids  # no specials added by the encoder
    assert tok.decode_tgt(ids) == text
    assert tok.decode_tgt([BOS] + ids + [EOS, PAD, PAD]) == text  # stops at </s>, skips <s> and <pad>
    assert tok.decode_tgt(ids + [EOS] + ids) == text


def test_spacy_detokeniser_flags():
    vocab = Vocab(SPECIALS + ["a", ".", "(", "b"], [0, 0, 0, 0, 0, 1, 2, 0])
    assert vocab.detokenize([4, 6, 7, 5, 4]) == "a (b. a"


def test_spacy_tokens_and_batch_encoding(spacy_tok):
    ids = spacy_tok.encode_src("Ein Hund liest.")
    assert spacy_tok.src_tokens(ids) == ["Ein", "Hund", "liest", "."]
    assert spacy_tok.tgt_tokens([BOS, 4]) == ["<s>", spacy_tok.tgt_vocab.itos[4]]
    assert encode_sources(spacy_tok, ["Ein Hund liest.", "Zwei Kinder"]) == [ids, spacy_tok.encode_src("Zwei Kinder")]
    assert spacy_tok.decode_src(ids) == "Ein Hund liest."


def test_spacy_state_rebuilds_identical_tokenizer(spacy_tok, tmp_path):
    state = _reload(spacy_tok.state_dict())
    json.dumps(state)  # primitives only
    again = tokenizer_from_state(state)
    assert isinstance(again, SpacyTokenizer)
    for text in TRAIN_EN:
        assert again.encode_tgt(text) == spacy_tok.encode_tgt(text)
        assert again.decode_tgt(again.encode_tgt(text)) == text
    spacy_tok.save(tmp_path)
    lines = (tmp_path / "vocab.en.txt").read_text(encoding="utf-8").splitlines()
    assert [ln.split("\t")[0] for ln in lines] == spacy_tok.tgt_vocab.itos
    assert tokenizer_from_state(json.loads((tmp_path / "tokenizer.json").read_text())).src_vocab.itos == \
        spacy_tok.src_vocab.itos


def test_spacy_lowercase():
    tok = SpacyTokenizer.train(TRAIN_DE, TRAIN_EN, "de", "en", min_freq=1, lowercase=True)
    assert "A" not in tok.tgt_vocab.stoi
    assert tok.decode_tgt(tok.encode_tgt("A DOG RUNS.")) == "a dog runs."


def test_bpe_shared_vocabulary_and_specials(bpe_tok):
    assert bpe_tok.shared_vocab and bpe_tok.src_vocab_size == bpe_tok.tgt_vocab_size == 150
    assert [bpe_tok.tok.token_to_id(s) for s in SPECIALS] == [PAD, UNK, BOS, EOS]
    ids = bpe_tok.encode_src("Ein Hund.")
    assert all(i > EOS for i in ids)  # no specials added
    assert "".join(bpe_tok.src_tokens(ids)).replace("▁", " ").strip() == "Ein Hund."


@pytest.mark.parametrize("text", TRAIN_DE[:3] + TRAIN_EN[:3] + ["Zwei  Hunde spielen  im Park.",
                                                                 "Ein unbekannter Mann."])
def test_bpe_round_trip(bpe_tok, text):
    ids = bpe_tok.encode_tgt(text)
    assert bpe_tok.decode_tgt(ids) == text  # every character was seen in training: exact, spacing included
    assert bpe_tok.decode_tgt([BOS] + ids + [EOS, PAD]) == text


def test_bpe_unseen_characters_are_unk(bpe_tok):
    ids = bpe_tok.encode_tgt("Ein Hund (🐕).")
    assert UNK in ids
    assert bpe_tok.decode_tgt(ids).startswith("Ein Hund")


def test_bpe_state_rebuilds_identical_tokenizer(bpe_tok, tmp_path):
    state = _reload(bpe_tok.state_dict())
    again = tokenizer_from_state(state)
    for text in TRAIN_DE + TRAIN_EN:
        assert again.encode_src(text) == bpe_tok.encode_src(text)
    bpe_tok.save(tmp_path)
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines()[:4] == SPECIALS
    from tokenizers import Tokenizer
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert saved.encode("Ein Hund.").ids == bpe_tok.encode_src("Ein Hund.")


def test_bpe_seen_targets_first(bpe_tok, tmp_path):
    """tokenizer.tgt_vocab=seen renumbers the shared vocabulary, segmentation unchanged: the types of the
    training targets first (after the specials), so the target side is the ids below n_tgt; a type only a
    held-out target uses is <unk> there, and the source side keeps it."""
    seen = bpe_tok.seen_targets_first([TRAIN_EN[:3], TRAIN_EN[3:]])
    target_types = {t for text in TRAIN_EN for t in bpe_tok.tok.encode(text, add_special_tokens=False).tokens}
    assert seen.tgt_vocab_size == len(SPECIALS) + len(target_types) < seen.src_vocab_size == bpe_tok.src_vocab_size
    assert {seen.tok.id_to_token(i) for i in range(len(SPECIALS), seen.tgt_vocab_size)} == target_types
    assert [seen.tok.id_to_token(i) for i in range(len(SPECIALS))] == SPECIALS
    for text in TRAIN_DE + TRAIN_EN:
        assert seen.tok.encode(text).tokens == bpe_tok.tok.encode(text).tokens
        assert seen.decode_src(seen.encode_src(text)) == bpe_tok.decode_src(bpe_tok.encode_src(text))
    for text in TRAIN_EN:
        assert max(seen.encode_tgt(text)) < seen.tgt_vocab_size
        assert seen.decode_tgt(seen.encode_tgt(text)) == bpe_tok.decode_tgt(bpe_tok.encode_tgt(text))
    german = next(t for t in bpe_tok.tok.encode(TRAIN_DE[0]).tokens if t not in target_types)
    assert seen.encode_tgt_batch([german.replace("▁", " ").strip()])[0][0] == UNK
    assert seen.encode_src(german.replace("▁", " ").strip())[0] >= seen.tgt_vocab_size
    again = tokenizer_from_state(json.loads(json.dumps(seen.state_dict())))
    assert again.tgt_vocab_size == seen.tgt_vocab_size and again.encode_tgt(TRAIN_EN[0]) == seen.encode_tgt(TRAIN_EN[0])
    assert "n_tgt" not in bpe_tok.state_dict() and bpe_tok.tgt_vocab_size == bpe_tok.src_vocab_size


def test_train_tokenizer_dispatch_and_errors():
    cfg = OmegaConf.structured(TokenizerConfig(name="bpe", vocab_size=100, min_freq=1))
    assert isinstance(train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN), BpeTokenizer)
    cfg.name = "wordpiece"
    with pytest.raises(ValueError, match="tokenizer.name='wordpiece'"):
        train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN)
    cfg.name, cfg.vocab_size = "bpe", 4
    with pytest.raises(ValueError, match="tokenizer.vocab_size=4"):
        train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN)
    cfg.vocab_size, cfg.tgt_vocab = 100, "seen"
    assert train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN).tgt_vocab_size < 100
    cfg.tgt_vocab = "english"
    with pytest.raises(ValueError, match="tokenizer.tgt_vocab='english': must be full or seen"):
        train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN)
    cfg.name, cfg.tgt_vocab = "spacy", "seen"
    with pytest.raises(ValueError, match="tokenizer.tgt_vocab=seen: needs tokenizer=bpe"):
        train_tokenizer(cfg, "de", "en", TRAIN_DE, TRAIN_EN)


def test_copy_and_unknown_states():
    from transformer.data.copy import CopyTokenizer
    tok = tokenizer_from_state({"name": "copy", "vocab_size": 11})
    assert isinstance(tok, CopyTokenizer) and tok.src_vocab_size == 11
    with pytest.raises(ValueError, match="unknown tokenizer state name='xyz'"):
        tokenizer_from_state({"name": "xyz"})
