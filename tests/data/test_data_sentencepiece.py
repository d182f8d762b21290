"""tokenizer=sentencepiece: trained on the training split (unigram or BPE, seeded, byte-identical), or an existing
.model file (renumbered to this project's special ids); round trips through checkpoints and the CLI."""
import gzip
import io
import json
import re
import sys

import pytest
import torch

from tests.helpers.cli import train_cmd
from tests.helpers.data import MULTI30K, TRAIN_DE, TRAIN_EN, VAL_DE, VAL_EN, data_cfg, needs_multi30k, write_corpus
from tests.helpers.dist import run_cli
from tests.helpers.inprocess import call_main
from transformer.data.preprocess import Options
from transformer.data.spm import MODEL_FILE, SentencePieceTokenizer
from transformer.data.store import Preprocessed
from transformer.data.tokenizer import tokenizer_from_state, train_tokenizer
from transformer.data.translation import preprocess_corpus
from transformer.specials import SPECIALS, UNK

spm = pytest.importorskip("sentencepiece")

# Numbered variations of the small corpus: enough text for a few hundred pieces.
DE = [f"{TRAIN_DE[i % 8][:-1]} {i % 13} mal." for i in range(96)]
EN = [f"{TRAIN_EN[i % 8][:-1]} {i % 13} times." for i in range(96)]
VOCAB = 60


def _train(model_type="unigram", **kw):
    return SentencePieceTokenizer.train([DE, EN], VOCAB, model_type, src_lang="de", tgt_lang="en", **kw)


def _reload(state: dict) -> dict:
    """What a checkpoint gives back: torch.save then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save({"tokenizer": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["tokenizer"]


def _plain_model(tmp_path, name="plain", **ids) -> str:
    """A .model trained by sentencepiece with its own defaults (<unk> <s> </s> at 0..2, no <pad>) or `ids`."""
    path = tmp_path / f"{name}.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(DE + EN), model_writer=f, vocab_size=VOCAB,
                                       minloglevel=2, num_threads=1, **ids)
    return str(path)


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_trained_model_specials_round_trip_and_determinism(model_type):
    tok = _train(model_type)
    assert tok.model_type == model_type and tok.shared_vocab
    assert tok.src_vocab_size == tok.tgt_vocab_size == VOCAB
    assert tok.tgt_tokens(range(4)) == SPECIALS
    for s in DE + EN + VAL_DE:
        ids = tok.encode_src(s)
        assert ids and min(ids) >= len(SPECIALS) and tok.decode_src(ids) == s
    assert tok.decode_tgt(tok.encode_tgt(EN[0]) + [3, 7, 8]) == EN[0]  # up to </s>
    assert tok.encode_src_batch(VAL_DE) == [tok.encode_src(s) for s in VAL_DE]
    assert _train(model_type).proto == tok.proto  # same sentences and seed: the same bytes
    assert _train(model_type, threads=1).proto != tok.proto or model_type == "bpe"  # the thread count is an input


def test_unknown_characters_are_unk_and_dropped_in_decoding():
    tok = _train()
    ids = tok.encode_src("Ein Zebra ©.")
    assert UNK in ids
    assert "©" not in tok.decode_src(ids) and "⁇" not in tok.decode_src(ids)
    with_bytes = SentencePieceTokenizer.train([DE, EN], VOCAB + 256, byte_fallback=True)
    assert UNK not in with_bytes.encode_src("Ein Zebra ©.")
    assert with_bytes.decode_src(with_bytes.encode_src("Ein Zebra ©.")) == "Ein Zebra ©."


def test_state_round_trips_through_a_checkpoint_and_json(tmp_path):
    tok = _train().seen_targets_first([EN])
    state = tok.state_dict()
    assert set(state) == {"name", "src_lang", "tgt_lang", "model_type", "model", "specials", "n_tgt"}
    for again in (tokenizer_from_state(_reload(state)), tokenizer_from_state(json.loads(json.dumps(state)))):
        assert again.proto == tok.proto and again.n_tgt == tok.n_tgt and again.tgt_lang == "en"
        assert again.encode_tgt_batch(VAL_EN) == tok.encode_tgt_batch(VAL_EN)
    tok.save(tmp_path)
    assert (tmp_path / MODEL_FILE).read_bytes() == tok.proto
    saved = spm.SentencePieceProcessor(model_file=str(tmp_path / MODEL_FILE))
    assert saved.encode(VAL_DE[0]) == tok.encode_src(VAL_DE[0])
    vocab = (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert [ln.split("\t")[0] for ln in vocab[:4]] == SPECIALS and len(vocab) == VOCAB


def test_seen_targets_first_keeps_the_segmentation():
    tok = _train()
    seen = tok.seen_targets_first([EN])
    assert seen.tgt_vocab_size < seen.src_vocab_size == tok.src_vocab_size
    for s in DE + EN + VAL_DE:
        assert seen.tgt_tokens(seen.encode_src(s)) == tok.tgt_tokens(tok.encode_src(s))
    assert all(i < seen.tgt_vocab_size for ids in seen.encode_tgt_batch(EN) for i in ids)
    german_only = [i for i in seen.encode_src("Hund Katze") if i >= seen.tgt_vocab_size]
    assert german_only and UNK in seen.encode_tgt("Hund Katze")


def test_an_existing_model_file_is_renumbered_to_the_project_specials(tmp_path):
    path = _plain_model(tmp_path)
    plain = spm.SentencePieceProcessor(model_file=path)
    assert (plain.unk_id(), plain.bos_id(), plain.eos_id(), plain.pad_id()) == (0, 1, 2, -1)
    cfg = data_cfg(tmp_path, tokenizer="sentencepiece", tok={"model_file": path}).tokenizer
    tok = train_tokenizer(cfg, "de", "en", ["ignored"], ["ignored"])
    assert tok.tgt_tokens(range(4)) == SPECIALS and tok.src_vocab_size == VOCAB + 1  # <pad> added
    for s in DE + EN + ["Ein Zebra ©."]:  # the same pieces (unknown characters included)
        assert tok.tgt_tokens(tok.encode_src(s)) == [plain.id_to_piece(i) if i else "<unk>" for i in plain.encode(s)]
    conforming = _plain_model(tmp_path, "ours", pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>")
    again = SentencePieceTokenizer.from_model_file(conforming)
    assert again.proto == open(conforming, "rb").read()  # already this project's layout: untouched


def test_preprocessing_is_seeded_and_byte_identical(tmp_path):
    files = {"train": write_corpus(tmp_path / "corpus", "train", DE, EN),
             "val": write_corpus(tmp_path / "corpus", "val", VAL_DE, VAL_EN)}

    def model(name, seed=1, sample=None, chunk=7, **tok):
        cfg = data_cfg(tmp_path, tokenizer="sentencepiece", seed=seed, files=files,
                       tok={"vocab_size": VOCAB, "train_sample": sample, **tok})
        folder = preprocess_corpus(cfg, tmp_path / name, Options(chunk_size=chunk, progress=False))
        return Preprocessed(folder).tokenizer_state["model"]

    full = model("a")
    assert model("b", chunk=1000) == full  # chunking does not change the model
    assert model("c", sample=100) == model("d", sample=100)  # the seed fixes the sample
    assert model("e", sample=100) != full and model("f", seed=2, sample=100) != model("g", seed=1, sample=100)
    assert model("h", model_type="bpe") != full


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    files = {"train": write_corpus(tmp_path / "corpus", "train", DE, EN),
             "val": write_corpus(tmp_path / "corpus", "val", VAL_DE, VAL_EN)}
    cfg = data_cfg(tmp_path, tokenizer="sentencepiece", files=files, tok={"vocab_size": VOCAB, "tgt_vocab": "seen"})
    one = preprocess_corpus(cfg, tmp_path / "one", Options(workers=1, chunk_size=10, progress=False))
    two = preprocess_corpus(cfg, tmp_path / "two", Options(workers=2, chunk_size=10, progress=False))
    assert {p.name: p.read_bytes() for p in one.iterdir()} == {p.name: p.read_bytes() for p in two.iterdir()}


def _lines_ok(res, pattern):
    """One `error:` line, the last (INFO lines about the input files may precede it)."""
    errors = [ln for ln in res.stderr.strip().splitlines() if "error" in ln.lower()]
    return len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0] and re.search(pattern, errors[0])


@pytest.mark.parametrize("args,message", [
    (["tokenizer.model_file=/nonexistent.model"], r"^error: tokenizer.model_file=/nonexistent.model: cannot read"),
    (["tokenizer.model_file=NOTAMODEL"], r"^error: tokenizer.model_file=.*: not a sentencepiece model"),
    (["tokenizer.model_type=word"], r"^error: tokenizer.model_type='word': must be unigram or bpe"),
    (["tokenizer.vocab_size=100000"], r"^error: tokenizer.vocab_size=100000: sentencepiece cannot train"),
    (["tokenizer.character_coverage=0"], r"^error: tokenizer.character_coverage=0.0: must be in \(0, 1\]"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, message, capfd):
    """transformer-preprocess in this process, what sentencepiece's C++ writes to the file descriptors captured
    too (the command's own process: test_preprocess_cli.py)."""
    from transformer.cli import preprocess

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "junk.model").write_bytes(b"not a model")
    args = [a.replace("NOTAMODEL", str(tmp_path / "corpus" / "junk.model")) for a in args]
    res = call_main(preprocess.main, ["data=files", "tokenizer=sentencepiece",
                                      f"data.files.train={write_corpus(tmp_path / 'corpus', 'train', DE, EN)}",
                                      f"data.files.val={write_corpus(tmp_path / 'corpus', 'val', VAL_DE, VAL_EN)}",
                                      f"preprocess.out_dir={tmp_path / 'bin'}", "preprocess.progress=false", *args],
                    tmp_path, prog="transformer-preprocess", capture=capfd)
    assert res.returncode == 2, res.stderr
    assert _lines_ok(res, message), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@needs_multi30k
@pytest.mark.slow
def test_multi30k_train_translate_evaluate_from_the_checkpoint(tmp_path):
    """A few steps on Multi30k with tokenizer=sentencepiece; the checkpoint alone then translates and scores."""
    run = tmp_path / "run"
    run_cli(train_cmd("data=multi30k", f"data.root={MULTI30K}", f"data.cache_dir={tmp_path / 'cache'}",
                      "tokenizer=sentencepiece", "tokenizer.vocab_size=2000", "tokenizer.tgt_vocab=seen",
                      "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "model.tie_embeddings=all",
                      "trainer.max_steps=4", "trainer.max_epochs=null", "trainer.val_every=4", "data.max_tokens=800",
                      "checkpoint.every_steps=4", "eval.bleu_sentences=20", "trainer.progress=false",
                      "trainer.accelerator=cpu", f"hydra.run.dir={run}"), tmp_path, timeout=600)
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    state = ckpt["tokenizer"]
    assert state["name"] == "sentencepiece" and state["model_type"] == "unigram"
    tok = tokenizer_from_state(state)
    assert tok.src_vocab_size == 2000 and tok.tgt_vocab_size < 2000
    assert (run / MODEL_FILE).read_bytes() == tok.proto
    with gzip.open(MULTI30K / "val.de.gz", "rt", encoding="utf-8") as f:
        src = [next(f).strip() for _ in range(5)]
    (tmp_path / "in.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    out = run_cli([sys.executable, "-m", "transformer.cli.translate", str(run / "checkpoints" / "last.pt"),
                   "--input", str(tmp_path / "in.de")], tmp_path)
    assert len(out.stdout.splitlines()) == 5
    res = run_cli([sys.executable, "-m", "transformer.cli.evaluate", str(run / "checkpoints" / "last.pt"),
                   "--split", "test_2016_flickr", "--out-dir", str(tmp_path / "eval")], tmp_path)
    scores = json.loads((tmp_path / "eval" / "test_2016_flickr.json").read_text())
    assert 0 <= scores["bleu"] <= 100 and "test_2016_flickr: BLEU" in res.stdout
    hyps = (tmp_path / "eval" / "test_2016_flickr.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 1000 and "▁" not in "".join(hyps)  # detokenised text, not pieces
