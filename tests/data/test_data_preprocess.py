"""Streaming, chunked, parallel preprocessing: the same ids as the in-memory pipeline, the same bytes for
any number of workers, BPE learnt from a seeded sample, and bad input refused with nothing written."""
import numpy as np
import pytest

from tests.helpers.data import MULTI30K, TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, data_cfg, needs_multi30k, write_corpus
from transformer.data.batch import Ragged
from transformer.data.corpus import read_parallel
from transformer.data.preprocess import Options, filter_pairs
from transformer.data.store import Preprocessed
from transformer.data.tokenizer import train_tokenizer
from transformer.data.translation import preprocess_corpus, split_files

# Quotes, brackets, double spaces, tabs, a literal special, an empty and an over-long pair: everything the
# streaming vocabulary statistics and the filters must get right across chunk boundaries.
EDGE_DE = TRAIN_DE + ['Er sagt "Hallo" und (lacht) .', "Zwei  Hunde\tspielen „draußen“.", "<unk> ist kein Wort.",
                      "", "Ein " + "sehr " * 12 + "langer Satz.", 'Sie ruft: "Komm!"', "Ein Hund, eine Katze."]
EDGE_EN = TRAIN_EN + ['He says "hello" and (laughs) .', "Two  dogs\tplay “outside”.", "<unk> is no word.",
                      "Nothing.", "A " + "very " * 12 + "long sentence.", 'She calls: "Come!"', "A dog, a cat."]


def edge_cfg(tmp_path, tokenizer="spacy", **data):
    files = {"train": write_corpus(tmp_path / "corpus", "train", EDGE_DE, EDGE_EN),
             "val": write_corpus(tmp_path / "corpus", "val", VAL_DE + ['"Ja" .'], VAL_EN + ['"Yes" .'])}
    data.setdefault("max_len", 12)
    return data_cfg(tmp_path, "files", tokenizer, files=files, tok={"min_freq": 1, "vocab_size": 150}, **data)


def in_memory_reference(cfg):
    """The ids and tokenizer of the pipeline before streaming: whole files, in-memory training, filter_pairs."""
    d = cfg.data
    files = {name: split_files(cfg, split) for name, split in (("train", d.train_split), ("valid", d.valid_split))}
    src, tgt = read_parallel(*files["train"])
    tok = train_tokenizer(cfg.tokenizer, d.src_lang, d.tgt_lang, src, tgt)
    out = {}
    for name, paths in files.items():
        s, t = read_parallel(*paths)
        si, ti = tok.encode_src_batch(s), tok.encode_tgt_batch(t)
        keep, _ = filter_pairs(si, ti, d.max_len, d.bad_pairs, *paths)
        out[name] = [Ragged.from_lists([ids[i] for i in keep]) for ids in (si, ti)]
        if name == "valid":
            out["text"] = ([s[i].strip() for i in keep], [t[i].strip() for i in keep])
    return tok.state_dict(), out


def assert_same_as_reference(folder, cfg):
    state, ref = in_memory_reference(cfg)
    pre = Preprocessed(folder)
    assert pre.tokenizer_state == state
    for name in ("train", "valid"):
        for side, r in zip(("src", "tgt"), ref[name], strict=False):
            got = Ragged.open(*pre.arrays(name, side))
            assert np.array_equal(got.offsets, r.offsets) and np.array_equal(got.data, r.data), (name, side)
    assert pre.valid_text() == ref["text"]


@pytest.mark.parametrize("tokenizer", ["spacy", "bpe", "bpe-seen", "sentencepiece", "sentencepiece-seen"])
@pytest.mark.parametrize("chunk", [1, 3, 10000])
def test_streaming_equals_in_memory_pipeline(tmp_path, tokenizer, chunk):
    spm = tokenizer.startswith("sentencepiece")  # its pieces are shorter on so little text: a longer max_len
    cfg = edge_cfg(tmp_path, tokenizer.split("-")[0], **({"max_len": 40} if spm else {}))
    if spm:
        cfg.tokenizer.vocab_size = 100
    if tokenizer.endswith("-seen"):  # the target side: the training targets' types, numbered first
        cfg.tokenizer.tgt_vocab = "seen"
    folder = preprocess_corpus(cfg, tmp_path / "bin", Options(chunk_size=chunk, progress=False))
    skipped = Preprocessed(folder).manifest["splits"]["train"]["skipped"]
    assert skipped["empty"] == 1 and skipped["too_long"] >= 1
    assert_same_as_reference(folder, cfg)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_any_number_of_workers_writes_the_same_bytes(tmp_path):
    """BPE here (its workers start fast); spaCy and 3 workers on Multi30k in the slow tier."""
    cfg = edge_cfg(tmp_path, "bpe")
    cfg.tokenizer.tgt_vocab = "seen"  # the workers map the target's other types to <unk>
    one = preprocess_corpus(cfg, tmp_path / "one", Options(workers=1, chunk_size=2, progress=False))
    two = preprocess_corpus(cfg, tmp_path / "two", Options(workers=2, chunk_size=2, progress=False))
    assert _files(one) == _files(two)
    manifest = Preprocessed(one).manifest
    assert manifest["vocab"]["tgt"] == manifest["tokenizer"]["n_tgt"] < manifest["vocab"]["src"]
    for split in ("train", "valid"):
        assert Ragged.open(*Preprocessed(one).arrays(split, "tgt")).data.max() < manifest["vocab"]["tgt"]


def test_bpe_learns_from_a_seeded_sample(tmp_path):
    def state(seed, sample, name):
        cfg = edge_cfg(tmp_path, "bpe", seed=seed, max_len=256)
        cfg.tokenizer.train_sample = sample
        return Preprocessed(preprocess_corpus(cfg, tmp_path / name, Options(chunk_size=4, progress=False))
                            ).tokenizer_state["json"]

    full = state(1, None, "full")
    assert state(1, 2 * len(EDGE_DE), "all") == full  # a sample as large as the corpus is the corpus
    assert state(1, 6, "a") == state(1, 6, "b")  # the seed fixes the sample
    assert state(1, 6, "a2") != full and state(2, 6, "c") != state(1, 6, "d")


def _leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in ("corpus", "root", "bad"))


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_pair_error_names_the_line_across_chunks(tmp_path, workers):
    cfg = edge_cfg(tmp_path, "bpe", bad_pairs="error", max_len=256)
    with pytest.raises(ValueError, match=rf"train\.de, line {len(TRAIN_DE) + 4}: empty sentence"):
        preprocess_corpus(cfg, tmp_path / "bin", Options(workers=workers, chunk_size=3, progress=False))
    assert _leftovers(tmp_path) == []  # neither the folder nor its hidden staging twin


@pytest.mark.parametrize("corrupt,message", [
    (lambda p: p.write_bytes(p.read_bytes() + b"one more\n"), r"train\.de has 16 lines but .*train\.en has 15"),
    (lambda p: p.write_bytes(p.read_bytes() + b"bad \xff\n"), r"train\.de, line 16: invalid UTF-8"),
    (lambda p: p.write_bytes(b"\n \n"), r"train\.de: file is empty"),
])
def test_bad_corpus_gives_todays_errors_and_writes_nothing(tmp_path, corrupt, message):
    cfg = edge_cfg(tmp_path)
    corrupt(tmp_path / "corpus" / "train.de")
    with pytest.raises(ValueError, match=message):
        preprocess_corpus(cfg, tmp_path / "bin", Options(chunk_size=2, progress=False))
    assert _leftovers(tmp_path) == []


def test_bad_options(tmp_path):
    cfg = edge_cfg(tmp_path)
    with pytest.raises(ValueError, match="preprocess.workers=0"):
        preprocess_corpus(cfg, tmp_path / "bin", Options(workers=0))
    cfg.tokenizer.train_sample = 0
    with pytest.raises(ValueError, match="tokenizer.train_sample=0: must be >= 1"):
        preprocess_corpus(cfg, tmp_path / "bin", Options())
    assert _leftovers(tmp_path) == []


@needs_multi30k
@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["spacy", "bpe"])
def test_multi30k_one_and_three_workers_equal_todays_ids(tmp_path, tokenizer):
    folder = tmp_path / "root" / "multi30k"
    folder.mkdir(parents=True)
    for f in MULTI30K.glob("*.gz"):
        (folder / f.name).symlink_to(f)
    cfg = data_cfg(tmp_path, "multi30k", tokenizer)
    one = preprocess_corpus(cfg, tmp_path / "one", Options(workers=1, progress=False))
    three = preprocess_corpus(cfg, tmp_path / "three", Options(workers=3, chunk_size=2500, progress=False))
    assert _files(one) == _files(three)
    assert_same_as_reference(one, cfg)
