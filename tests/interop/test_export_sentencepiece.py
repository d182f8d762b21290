"""transformer-export of `tokenizer=sentencepiece` models, with the real `transformers`, `ctranslate2` and
`sentencepiece` (nothing is downloaded): the Hugging Face folder's MarianTokenizer gives the project's ids, the
exported models' greedy outputs equal ours token for token, and the folder imports back as the same tokenizer."""
import json
import shutil

import pytest
import torch
from helpers.export import LINES, PAIRS, SRC, checkpoint, spm_tokenizer, trained_model
from helpers.models import one_thread  # noqa: F401  (autouse)

from transformer.cli import export as export_cli
from transformer.cli import translate as translate_cli
from transformer.config import EvalConfig, ModelConfig
from transformer.data.copy import CopyTokenizer
from transformer.decoding.translate import encode_batch, translate_sentences
from transformer.interop import InteropError
from transformer.model import ModelArgs, Transformer
from transformer.specials import BOS, EOS, SPECIALS, UNK
from transformer.training.components.checkpoint import atomic_save

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
from transformer.interop.ct2 import SUPPRESSED, export_ct2, source_tokens  # noqa: E402
from transformer.interop.hf import export_hf, import_hf  # noqa: E402

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")  # MarianTokenizer's note
GREEDY = EvalConfig(beam=1, max_len_a=1.2, max_len_b=10)
VARIANTS = [("decoder", False), ("all", True), ("none", True)]  # (tie_embeddings, tokenizer.tgt_vocab=seen)
# Text that segments in more than one way: a character the vocabulary lacks, forms NFKC normalises (full-width
# letters, a ligature), runs of spaces and a tab, nothing at all.
ODD = ["Ein Zebra © läuft.", "  Zwei   Hunde  spielen ", "Ｚwei ﬁsche 42 mal!", "", "Kinder\tspielen."]


def untrained(tok) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=64)
    return Transformer.from_config(cfg, tok.src_vocab_size, tok.tgt_vocab_size, shared_vocab=True).eval()


@pytest.mark.parametrize("model_type,byte_fallback", [("unigram", False), ("bpe", False), ("unigram", True)])
def test_hf_tokenizer_gives_our_ids_and_text(model_type, byte_fallback, tmp_path):
    tok = spm_tokenizer(False, model_type, byte_fallback)
    export_hf(untrained(tok), tok, {}, tmp_path / "hf")
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"source.spm", "target.spm", "vocab.json"} <= files and "tokenizer.json" not in files
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf_tok).__name__ == "MarianTokenizer"
    texts = LINES + ODD
    ours = tok.encode_src_batch(texts)
    assert (UNK in ours[len(LINES)]) != byte_fallback  # the check covers characters the vocabulary lacks
    assert [hf_tok(t).input_ids for t in texts] == [ids + [EOS] for ids in ours]
    for ids in ours[:len(LINES)]:
        assert hf_tok.decode(ids + [EOS], skip_special_tokens=True) == tok.decode_src(ids)


@pytest.mark.parametrize("tie,seen", VARIANTS)
def test_hf_greedy_equals_ours_and_the_folder_imports_back(tie, seen, tmp_path):
    model, tok = trained_model(tie, seen, kind="sentencepiece"), spm_tokenizer(seen)
    export_hf(model, tok, {}, tmp_path / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    ours = translate_sentences(model, tok, SRC, GREEDY)
    assert len({h[0].text for h in ours}) > len(SRC) // 2  # sentences, not one repeated output
    for sentence, hyps in zip(SRC, ours, strict=True):
        ids = hf_tok(sentence, return_tensors="pt")
        limit = int(GREEDY.max_len_a * ids.input_ids.size(1) + GREEDY.max_len_b)
        out = hf.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=limit)[0].tolist()
        out = out[1:-1] if out[-1] == EOS else out[1:]  # without <s> and </s>
        assert out == hyps[0].tokens, sentence
        assert hf_tok.decode(out, skip_special_tokens=True) == hyps[0].text
    ckpt = import_hf(tmp_path / "hf")
    assert ckpt["tokenizer"] == tok.state_dict()  # tokenizer=sentencepiece again, tgt_vocab=seen included
    assert ckpt["model_args"] == model.args.to_dict()
    back = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
    back.load_state_dict(ckpt["model"])
    src = encode_batch(tok.encode_src_batch(SRC[:4]), "cpu")
    tgt = encode_batch(tok.encode_tgt_batch([t for _, t in PAIRS[:4]]), "cpu")
    tgt_in = torch.cat([torch.full((4, 1), BOS), tgt[:, :-1]], dim=1)
    with torch.no_grad():
        assert torch.equal(back.eval()(src, tgt_in), model(src, tgt_in))


@pytest.mark.parametrize("tie,seen,norm_first", [("decoder", False, False), ("all", True, False),
                                                 ("decoder", True, True)])
def test_ctranslate2_with_the_folders_sentencepiece_model_equals_ours(tie, seen, norm_first, tmp_path):
    """What a CTranslate2 user does: segment with the folder's sentencepiece.model, append </s>, translate, and
    join the output pieces with it again."""
    model, tok = trained_model(tie, seen, norm_first, kind="sentencepiece"), spm_tokenizer(seen)
    export_ct2(model, tok, tmp_path / "ct2")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "sentencepiece.model"))
    texts = SRC + ODD[:1]
    tokens = [sp.encode(t, out_type=str) + [SPECIALS[EOS]] for t in texts]
    assert tokens[:-1] == source_tokens(tok, SRC)  # the unknown "©" differs in spelling only: both are <unk>
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)  # no idle spinners
    ours = translate_sentences(model, tok, texts, GREEDY)
    scored = translator.score_batch(tokens, [tok.tgt_tokens(h[0].tokens) for h in ours])
    for s, h in zip(scored, ours, strict=True):
        torch.testing.assert_close(torch.tensor(s.log_probs[:len(h[0].positional)]), torch.tensor(h[0].positional),
                                   atol=1e-4, rtol=1e-4)
    for src_tokens, h in zip(tokens, ours, strict=True):
        limit = int(GREEDY.max_len_a * len(src_tokens) + GREEDY.max_len_b)
        out = translator.translate_batch([src_tokens], beam_size=1, max_decoding_length=limit,
                                         suppress_sequences=SUPPRESSED)[0].hypotheses[0]
        assert out == tok.tgt_tokens(h[0].tokens)
        assert sp.decode(out) == h[0].text


def test_cli_exports_both_formats_and_translate_reads_the_hf_folder(tmp_path, capsys):
    model, tok = trained_model("all", True, kind="sentencepiece"), spm_tokenizer(True)
    atomic_save(checkpoint(model, tok), tmp_path / "m.pt")
    for to in ("hf", "ctranslate2"):
        assert export_cli.main([str(tmp_path / "m.pt"), "--to", to, "--out", str(tmp_path / to)]) == 0
    saved = json.loads((tmp_path / "ctranslate2" / "transformer_tokenizer.json").read_text(encoding="utf-8"))
    assert saved == tok.state_dict()
    (tmp_path / "in.txt").write_text("\n".join(SRC) + "\n", encoding="utf-8")
    outputs = []
    capsys.readouterr()
    for source in ("m.pt", "hf"):
        assert translate_cli.main([str(tmp_path / source), "--beam", "1", "--input", str(tmp_path / "in.txt")]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == len(SRC)


@pytest.mark.parametrize("to,message", [
    ("hf", "tokenizer=copy: a Hugging Face export needs tokenizer=bpe or sentencepiece; the copy task's"),
    ("ctranslate2", "tokenizer=copy: CTranslate2 export needs bpe, sentencepiece, spacy or sentencepiece_pair"),
])
def test_what_is_still_unsupported_is_one_line(to, message, tmp_path, capsys):
    tok = CopyTokenizer(12)
    torch.manual_seed(0)
    model = Transformer.from_config(ModelConfig(N=1, d_model=16, d_ff=32, h=2), 12, 12, shared_vocab=True)
    atomic_save(checkpoint(model, tok), tmp_path / "c.pt")
    assert export_cli.main([str(tmp_path / "c.pt"), "--to", to, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transformer-export: error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_an_altered_export_is_refused_on_import_in_one_line(tmp_path):
    """Without transformer.json, MarianTokenizer's files cannot say which outputs tgt_vocab=seen leaves out; with
    it, source.spm and target.spm must be the one model vocab.json numbers."""
    model, tok = trained_model("all", True, kind="sentencepiece"), spm_tokenizer(True)
    export_hf(model, tok, {}, tmp_path / "hf")
    shutil.copytree(tmp_path / "hf", tmp_path / "no_meta")
    (tmp_path / "no_meta" / "transformer.json").unlink()
    with pytest.raises(InteropError, match=r"no_meta: final_logits_bias leaves \d+ of \d+ rows unscored"):
        import_hf(tmp_path / "no_meta")
    (tmp_path / "hf" / "target.spm").write_bytes(spm_tokenizer(False, "bpe").proto)
    with pytest.raises(InteropError, match="transformer.json says tokenizer=sentencepiece, but source.spm, target"):
        import_hf(tmp_path / "hf")
