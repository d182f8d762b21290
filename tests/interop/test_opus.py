"""A released OPUS-MT folder (Hugging Face MarianMTModel with MarianTokenizer's SentencePiece files, Marian's
vocabulary order) imports: the same ids as MarianTokenizer on both sides, the same logits and greedy output as
`transformers`, fine-tuning with trainer.init_from keeps its tokenizer. The folder is built offline
(tests/helpers/opus.py): nothing is downloaded."""
import pytest
import torch
from helpers.data import needs_multi30k
from helpers.models import one_thread  # noqa: F401  (autouse)

from transformer.config import EvalConfig
from transformer.decoding.translate import translate_sentences
from transformer.interop import InteropError
from transformer.specials import BOS, EOS, PAD, UNK
from transformer.training.components.checkpoint import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
from helpers.opus import fake_opus, multi30k_lines  # noqa: E402

from transformer.interop.hf import import_hf  # noqa: E402
from transformer.interop.names import residual_permutation  # noqa: E402
from transformer.interop.opus import NEVER  # noqa: E402

pytestmark = [needs_multi30k, pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")]
transformers.utils.logging.disable_progress_bar()
GREEDY = EvalConfig(beam=1, max_len_a=1.2, max_len_b=10)


@pytest.fixture(scope="module")
def opus(tmp_path_factory):
    """(folder, MarianMTModel, MarianTokenizer, our model, our tokenizer, Marian id -> our id)."""
    folder = tmp_path_factory.mktemp("opus") / "opus-mt-de-en"
    hf, hf_tok = fake_opus(folder, train_steps=80)  # greedy outputs end (20 of 20), beam 4 agrees (20 of 20)
    model, tok, _ = load_model(folder)
    ours = {hf_tok.convert_tokens_to_ids(p) if i >= 4 else None: i for i, p in enumerate(tok.pieces)}
    ours.update({hf.config.decoder_start_token_id: BOS, hf.config.eos_token_id: EOS, hf_tok.unk_token_id: UNK})
    del ours[None]
    return folder, hf, hf_tok, model, tok, ours


def validation(n: int):
    de, en = multi30k_lines(n, "val")
    return de, en


def test_the_folder_is_laid_out_as_released_and_imports_with_its_architecture(opus):
    folder, hf, hf_tok, model, tok, ours = opus
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "source.spm", "target.spm", "tokenizer_config.json",
                                                        "vocab.json"]
    V = hf.config.vocab_size
    assert (hf.config.pad_token_id, hf.config.decoder_start_token_id, hf.config.eos_token_id) == (V - 1, V - 1, 0)
    a = model.args
    assert (a.activation, a.output_bias, a.tie_embeddings, a.src_vocab_size, a.tgt_vocab_size) == (
        "swish", True, "all", V + 1, V + 1)  # <pad> gets a row of its own, <s> is Marian's <pad> row
    assert tok.name == "sentencepiece_pair" and (tok.src_lang, tok.tgt_lang) == ("de", "en")
    assert sorted(ours.values()) == list(range(1, V + 1))  # every Marian id has one of ours, <pad> is new
    emb, start = model.tgt_embed.tokens.weight, hf.model.shared.weight[V - 1]
    perm = residual_permutation(a.d_model)  # Marian's coordinate j is our perm[j]
    assert torch.equal(emb[BOS][perm], start) and start.abs().sum() > 0  # the decoder starts from Marian's start row
    assert not emb[PAD].any() and model.generator.bias[PAD] == model.generator.bias[BOS] == NEVER
    assert import_hf(folder)["config"] == {"eval": {"beam": 4}}  # generation_config.json's num_beams


def test_ids_equal_marian_tokenizers_on_both_sides(opus):
    _, hf, hf_tok, _, tok, ours = opus
    de, en = validation(50)
    sp = tok.sp["tgt"]
    dropped = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i) not in tok.index]
    odd = ["Ein Mann </s> fährt <unk> Rad.", ">>en<< Ein Hund 🙂 ß", " ".join(p.lstrip("\u2581") for p in dropped), ""]
    for side, texts in (("src", de + odd), ("tgt", en + odd)):
        theirs = hf_tok(texts).input_ids if side == "src" else hf_tok(text_target=texts).input_ids
        mine = tok.encode_src_batch(texts) if side == "src" else tok.encode_tgt_batch(texts)
        assert [[ours[i] for i in ids] for ids in theirs] == [ids + [EOS] for ids in mine], side
    assert UNK in tok.encode_tgt(odd[2])  # the test meets a piece missing from vocab.json


def marian_batch(hf_tok, n: int = 8):
    de, en = validation(n)
    b = hf_tok(de, text_target=en, return_tensors="pt", padding=True)
    labels = b["labels"]
    start = torch.full((n, 1), hf_tok.pad_token_id)
    return b["input_ids"], b["attention_mask"], torch.cat([start, labels[:, :-1]], dim=1)


def test_logits_equal_transformers_teacher_forced(opus):
    _, hf, hf_tok, model, _, ours = opus
    src, mask, tgt_in = marian_batch(hf_tok)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits  # (B, T, V)
        remap = torch.full((hf.config.vocab_size + 1,), PAD)
        remap[torch.tensor(list(ours))] = torch.tensor(list(ours.values()))
        # Marian pads with its <pad> (its decoder start); here padding is <pad>, and the start is <s>
        src_ours = remap[src].masked_fill(mask == 0, PAD)
        tgt_ours = remap[tgt_in].masked_fill(tgt_in == hf_tok.pad_token_id, PAD)
        tgt_ours[:, 0] = BOS
        mine = model(src_ours, tgt_ours)
    cols = torch.tensor([i for i in ours if i != hf.config.pad_token_id])
    real = (tgt_ours != PAD)[..., None]  # positions Marian's labels cover
    torch.testing.assert_close((mine[..., remap[cols]] * real), theirs[..., cols] * real, atol=2e-5, rtol=1e-5)
    # The softmax: ours over the real pieces only (<pad>, <s> get exactly 0), as Marian's renormalised one.
    assert bool((mine.log_softmax(-1)[..., [PAD, BOS]].exp() == 0).all())
    torch.testing.assert_close(mine.log_softmax(-1)[..., remap[cols]] * real,
                               theirs[..., cols].log_softmax(-1) * real, atol=2e-5, rtol=1e-5)


def test_greedy_equals_transformers_generate(opus):
    _, hf, hf_tok, model, tok, ours = opus
    de, _ = validation(20)
    hyps = translate_sentences(model, tok, de, GREEDY)
    ended = 0
    for sentence, h in zip(de, hyps, strict=True):
        ids = hf_tok(sentence, return_tensors="pt")
        limit = int(GREEDY.max_len_a * ids.input_ids.size(1) + GREEDY.max_len_b)
        out = hf.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=limit,
                          forced_eos_token_id=None)[0].tolist()  # ours cuts at the limit without forcing </s>
        out = out[1:]  # without the start
        ended += out[-1] == hf.config.eos_token_id
        assert [ours[i] for i in out if i != hf.config.eos_token_id] == h[0].tokens, sentence
        assert hf_tok.decode(out, skip_special_tokens=True) == h[0].text == tok.decode_tgt(h[0].tokens)
    assert ended >= len(de) // 2  # most outputs are sentences that end, not runs to the limit


def test_beam_search_agrees_with_transformers_generate(opus):
    """Beam 4 with the folder's generation config (renormalize_logits, <pad> banned) and length penalty 1 on both
    sides (ours: logprob / n, HF: logprob / length): the same log-probabilities, so nearly always the same
    output; the few a tie or a stopping rule could change are allowed."""
    _, hf, hf_tok, model, tok, _ = opus
    de, _ = validation(20)
    hyps = translate_sentences(model, tok, de, EvalConfig(beam=4, lenpen=1.0, max_len_a=1.2, max_len_b=10))
    differ = []
    for sentence, h in zip(de, hyps, strict=True):
        ids = hf_tok(sentence, return_tensors="pt")
        limit = int(1.2 * ids.input_ids.size(1) + 10)
        out = hf.generate(**ids, num_beams=4, length_penalty=1.0, early_stopping=True, max_new_tokens=limit,
                          max_length=None, forced_eos_token_id=None)[0].tolist()
        if hf_tok.decode(out, skip_special_tokens=True) != h[0].text:
            differ.append(sentence)
    assert len(differ) <= len(de) // 10, differ


def test_translate_and_evaluate_accept_the_folder(opus, tmp_path, capsys):
    from transformer.cli import evaluate as evaluate_cli
    from transformer.cli import translate as translate_cli
    folder, _, _, model, tok, _ = opus
    de, en = validation(5)
    (tmp_path / "in.de").write_text("\n".join(de) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    assert translate_cli.main([str(folder), "--beam", "1", "--input", str(tmp_path / "in.de")]) == 0
    got = capsys.readouterr().out.splitlines()
    assert got == [h[0].text for h in translate_sentences(model, tok, de, EvalConfig(beam=1))]
    assert evaluate_cli.main([str(folder), "--src", str(tmp_path / "in.de"), "--ref", str(tmp_path / "ref.en"),
                              "--beam", "1", "--out-dir", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "in.de.hyp").read_text(encoding="utf-8").splitlines() == got


def test_older_release_layouts_import_alike(opus, tmp_path):
    """Older OPUS-MT uploads: pytorch_model.bin, generation settings inside config.json, a tokenizer_config.json
    holding only the languages."""
    import json
    import shutil

    from safetensors.torch import load_file
    folder, hf, _, model, _, _ = opus
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    cfg = json.loads((old / "config.json").read_text(encoding="utf-8"))
    V = cfg["vocab_size"]
    cfg.update(bad_words_ids=[[V - 1]], num_beams=4, max_length=512, transformers_version="4.22.0.dev0")
    (old / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (old / "tokenizer_config.json").write_text('{"target_lang": "en", "source_lang": "de"}', encoding="utf-8")
    (old / "generation_config.json").unlink()
    torch.save(load_file(old / "model.safetensors"), old / "pytorch_model.bin")
    (old / "model.safetensors").unlink()
    again, tok, _ = load_model(old)
    assert again.args == model.args and tok.state_dict() == load_model(folder)[1].state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    assert import_hf(old)["config"] == {"eval": {"beam": 4}}  # num_beams read from config.json


def test_preprocessing_with_the_imported_tokenizer_any_workers(opus, tmp_path):
    """The preprocessing kernel of the imported tokenizer (spawned workers load its state from a file): the ids
    are the tokenizer's own, and 1 and 2 workers write the same bytes."""
    from helpers.data import data_cfg, write_corpus

    from transformer.data.batch import Ragged
    from transformer.data.preprocess import Options
    from transformer.data.store import Preprocessed
    from transformer.data.translation import preprocess_corpus
    tok = opus[4]
    de, en = multi30k_lines(40)
    vde, ven = validation(8)
    files = {"train": write_corpus(tmp_path / "c", "train", de, en),
             "val": write_corpus(tmp_path / "c", "val", vde, ven)}
    cfg = data_cfg(tmp_path, "files", "bpe", files=files, max_len=500)
    folders = [preprocess_corpus(cfg, tmp_path / f"w{n}", Options(workers=n, chunk_size=7, progress=False),
                                 tokenizer_state=tok.state_dict()) for n in (1, 2)]
    read = [{p.name: p.read_bytes() for p in sorted(f.iterdir())} for f in folders]
    assert read[0] == read[1]
    pre = Preprocessed(folders[0])
    assert pre.tokenizer_state == tok.state_dict()
    for side, ids in (("src", tok.encode_src_batch(de)), ("tgt", tok.encode_tgt_batch(en))):
        got = Ragged.open(*pre.arrays("train", side))
        assert [got.data[a:b].tolist() for a, b in zip(got.offsets[:-1], got.offsets[1:], strict=True)] == ids


def test_what_does_not_map_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "opus"
    fake_opus(folder)
    (folder / "tokenizer_config.json").write_text('{"separate_vocabs": true}', encoding="utf-8")
    with pytest.raises(InteropError, match="separate_vocabs=true"):
        import_hf(folder)
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<unk>"}', encoding="utf-8")
    with pytest.raises(InteropError, match="config.json eos_token_id=0, but vocab.json has <unk> at 1"):
        import_hf(folder)


def test_init_from_the_folder_fine_tunes_with_its_tokenizer(opus, tmp_path):
    """trainer.init_from=DIR: a config without the folder's architecture is refused in one line that lists the
    overrides (checked in this process: the refusal's way to exit code 2 is test_init_from.py's); with them, the
    run (transformer-train's main() in this process) trains and keeps the imported tokenizer."""
    import re

    from helpers.cli import compose_cfg
    from helpers.data import write_corpus
    from helpers.inprocess import call_main

    from transformer.cli import train as train_cli
    from transformer.config import ConfigError
    from transformer.training.components.checkpoint import load_checkpoint
    from transformer.training.components.init_from import prepare_init_from
    folder = opus[0]
    de, en = multi30k_lines(64)
    vde, ven = validation(8)
    base = ["data=files", f"data.files.train={write_corpus(tmp_path / 'c', 'train', de, en)}",
            f"data.files.val={write_corpus(tmp_path / 'c', 'val', vde, ven)}", "data.max_tokens=300",
            "trainer.max_steps=3", "trainer.max_epochs=null", "trainer.val_every=100", "checkpoint.every_steps=100",
            "optim.warmup=10", "eval.bleu=false", "trainer.progress=false", "trainer.accelerator=cpu",
            f"trainer.init_from={folder}", "model.N=1", "logger.trackers=[]"]  # no TensorBoard figures
    with pytest.raises(ConfigError) as refused:
        prepare_init_from(compose_cfg(*base))
    why = str(refused.value)
    assert "\n" not in why
    fix = re.search(r"holds a model this config does not build: set (.*) \(this config has", why).group(1)
    assert "model.activation=swish" in fix and "model.output_bias=true" in fix and "model.N=2" in fix
    # transformer-train in this process (test_init_from.py starts the init_from runs as processes)
    res = call_main(train_cli.main, [*base, *fix.split(), f"hydra.run.dir={tmp_path / 'tuned'}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    tuned = load_checkpoint(tmp_path / "tuned" / "checkpoints" / "last.pt")
    imported = import_hf(folder)
    assert tuned["tokenizer"] == imported["tokenizer"] and tuned["trainer"]["step"] == 3
    changed = [k for k, v in imported["model"].items() if not torch.equal(tuned["model"][k], v)]
    assert changed  # it trained
    from transformer.cli import export as export_cli
    last = str(tmp_path / "tuned" / "checkpoints" / "last.pt")
    assert export_cli.main([last, "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert import_hf(tmp_path / "hf")["tokenizer"]["pieces"] == imported["tokenizer"]["pieces"]


def test_the_imported_model_exports_to_hf_and_ctranslate2(opus, tmp_path):
    """Back out as a MarianMTModel folder with MarianTokenizer's files (in this project's numbering) and as a
    CTranslate2 model: the same greedy output; the HF folder imports again with identical logits."""
    from transformer.interop.ct2 import SUPPRESSED, export_ct2, source_tokens
    from transformer.interop.hf import export_hf
    from transformer.model import ModelArgs, Transformer
    _, _, _, model, tok, _ = opus
    de, _ = validation(10)
    hyps = translate_sentences(model, tok, de, GREEDY)
    export_hf(model, tok, {}, tmp_path / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf_tok).__name__ == "MarianTokenizer"
    for sentence, h in zip(de, hyps, strict=True):
        ids = hf_tok(sentence, return_tensors="pt")
        assert ids.input_ids[0].tolist() == tok.encode_src(sentence) + [EOS]
        limit = int(GREEDY.max_len_a * ids.input_ids.size(1) + GREEDY.max_len_b)
        out = hf.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=limit)[0].tolist()[1:]
        assert [i for i in out if i != EOS] == h[0].tokens
        assert hf_tok.decode(out, skip_special_tokens=True) == h[0].text
    back = import_hf(tmp_path / "hf")
    again = Transformer(ModelArgs.from_dict(back["model_args"]))
    again.load_state_dict(back["model"])
    src = torch.tensor([tok.encode_src(de[0]) + [EOS]])
    tgt_in = torch.tensor([[BOS] + h[0].tokens for h in hyps[:1]])
    with torch.no_grad():
        assert torch.equal(again.eval()(src, tgt_in), model(src, tgt_in))
    ct2 = pytest.importorskip("ctranslate2")
    export_ct2(model, tok, tmp_path / "ct2")
    translator = ct2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)  # no threads spinning idle
    for tokens, h in zip(source_tokens(tok, de), hyps, strict=True):
        limit = int(GREEDY.max_len_a * len(tokens) + GREEDY.max_len_b)
        out = translator.translate_batch([tokens], beam_size=1, max_decoding_length=limit,
                                         suppress_sequences=SUPPRESSED)[0].hypotheses[0]
        assert out == tok.tgt_tokens(h[0].tokens)
