"""transformer-export and the Hugging Face importer on small models, with the real `transformers` and
`ctranslate2` (nothing is downloaded): same logits, same greedy output, round trips, one-line refusals."""
import dataclasses
import json
import sys

import pytest
import torch
from helpers.export import SRC, checkpoint, tokenizer, trained_model
from helpers.models import one_thread  # noqa: F401  (autouse)

from transformer.cli import export as export_cli
from transformer.cli import translate as translate_cli
from transformer.config import EvalConfig
from transformer.data.tokenizer import BpeTokenizer, SpacyTokenizer, Vocab
from transformer.decoding.translate import encode_batch, translate_sentences
from transformer.interop import InteropError
from transformer.model import ModelArgs, Transformer
from transformer.specials import EOS, SPECIALS
from transformer.training.components.checkpoint import atomic_save, load_checkpoint

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
from transformer.interop.ct2 import SUPPRESSED, export_ct2, source_tokens  # noqa: E402
from transformer.interop.hf import export_hf, import_hf, marian_model  # noqa: E402

transformers.utils.logging.disable_progress_bar()
VARIANTS = [("decoder", False), ("all", False), ("all", True), ("none", True)]  # (tie_embeddings, tgt_vocab=seen)
SWITCHES = [("swish", True), ("gelu", False)]  # (model.activation, model.output_bias) as released Marian models
GREEDY = EvalConfig(beam=1, max_len_a=1.2, max_len_b=10)


def our_logits(model, src, tgt_in):
    with torch.no_grad():
        return model(src, tgt_in).float()


def batch(tok):
    src = encode_batch(tok.encode_src_batch(SRC[:4]), "cpu")  # (4, S), right-padded
    tgt = encode_batch(tok.encode_tgt_batch(["A man rides.", "Two dogs play in the snow.", "A", "Children."]), "cpu")
    tgt_in = torch.cat([torch.full((4, 1), 2), tgt[:, :-1]], dim=1)  # <s> first
    return src, tgt_in


@pytest.mark.parametrize("tie,seen", VARIANTS)
def test_marian_computes_our_logits(tie, seen):
    model, tok = trained_model(tie, seen), tokenizer(seen)
    src, tgt_in = batch(tok)
    hf = marian_model(model)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt_in).logits
    ours = our_logits(model, src, tgt_in)
    n = model.args.tgt_vocab_size
    torch.testing.assert_close(theirs[..., :n], ours, atol=2e-5, rtol=1e-5)
    assert bool((theirs[..., n:] == -float("inf")).all())  # tgt_vocab=seen on a shared matrix: never output


@pytest.mark.parametrize("tie,seen,activation,output_bias", [(t, s, "relu", False) for t, s in VARIANTS]
                         + [("all", True, a, b) for a, b in SWITCHES])
def test_export_then_import_gives_identical_logits(tie, seen, activation, output_bias, tmp_path):
    model = trained_model(tie, seen, activation=activation, output_bias=output_bias)
    tok = tokenizer(seen)
    export_hf(model, tok, {}, tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf")
    assert ckpt["model_args"] == model.args.to_dict()
    back = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
    back.load_state_dict(ckpt["model"])
    src, tgt_in = batch(tok)
    assert torch.equal(our_logits(back.eval(), src, tgt_in), our_logits(model, src, tgt_in))
    tok2 = BpeTokenizer.from_state(ckpt["tokenizer"])
    assert (tok2.src_lang, tok2.tgt_lang, tok2.tgt_vocab_size) == ("de", "en", tok.tgt_vocab_size)
    assert tok2.encode_src_batch(SRC) == tok.encode_src_batch(SRC)


def test_hf_folder_loads_with_auto_classes_and_greedy_equals_ours(tmp_path):
    """What a user of `transformers` does with the folder: the fast tokenizer appends </s> like our batches,
    and greedy generation gives our greedy output token for token."""
    model, tok = trained_model(), tokenizer()
    export_hf(model, tok, {}, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp folder left
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf).__name__ == "MarianMTModel"
    ours = translate_sentences(model, tok, SRC, GREEDY)
    for sentence, hyps in zip(SRC, ours, strict=True):
        ids = hf_tok(sentence, return_tensors="pt")
        assert ids.input_ids[0].tolist() == tok.encode_src(sentence) + [EOS]
        limit = int(GREEDY.max_len_a * ids.input_ids.size(1) + GREEDY.max_len_b)
        out = hf.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=limit)[0].tolist()
        out = out[1:-1] if out[-1] == EOS else out[1:]  # without <s> and </s>
        assert out == hyps[0].tokens
        assert hf_tok.decode(out, skip_special_tokens=True) == hyps[0].text


def ct2_logprobs(folder, tok, model, compute_type="default"):
    """CTranslate2's per-token log probabilities of our greedy outputs, and ours."""
    # One thread: a new translator's idle threads spin on the cores torch needs next (1-3 s a test on 2 cores).
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type=compute_type, intra_threads=1)
    hyps = translate_sentences(model, tok, SRC, GREEDY)
    targets = [tok.tgt_tokens(h[0].tokens) for h in hyps]
    scored = translator.score_batch(source_tokens(tok, SRC), targets)
    return [s.log_probs for s in scored], [h[0].positional for h in hyps], translator, hyps


@pytest.mark.parametrize("tie,seen,norm_first,switches", [(t, s, False, ("relu", False)) for t, s in VARIANTS]
                         + [("decoder", True, True, ("relu", False))] + [("all", True, False, x) for x in SWITCHES])
def test_ctranslate2_scores_and_greedy_equal_ours(tie, seen, norm_first, switches, tmp_path):
    model = trained_model(tie, seen, norm_first, activation=switches[0], output_bias=switches[1])
    tok = tokenizer(seen)
    export_ct2(model, tok, tmp_path / "ct2")
    theirs, ours, translator, hyps = ct2_logprobs(tmp_path / "ct2", tok, model)
    for a, b in zip(theirs, ours, strict=True):
        torch.testing.assert_close(torch.tensor(a[:len(b)]), torch.tensor(b), atol=1e-4, rtol=1e-4)
    for sentence, src_tokens, h in zip(SRC, source_tokens(tok, SRC), hyps, strict=True):
        limit = int(GREEDY.max_len_a * len(src_tokens) + GREEDY.max_len_b)
        out = translator.translate_batch([src_tokens], beam_size=1, max_decoding_length=limit,
                                         suppress_sequences=SUPPRESSED)[0].hypotheses[0]
        assert out == tok.tgt_tokens(h[0].tokens), sentence


def test_ctranslate2_int8_loads_and_scores_close(tmp_path):
    model, tok = trained_model(), tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_ct2(model, tok, tmp_path / "int8", quantization="int8")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # quantised copies, not the model
    theirs, ours, _, _ = ct2_logprobs(tmp_path / "int8", tok, model, compute_type="int8")
    # zip(a, b): an output cut at its length limit has no </s>, which score_batch scores all the same
    diffs = [abs(x - y) for a, b in zip(theirs, ours, strict=True) for x, y in zip(a, b, strict=False)]
    # quantised: not the float32 numbers, but near them on average; a single token moves further where the CPU's
    # int8 products lack VNNI (docs/interop.md), while a wrong weight or scale moves every token by nats
    assert 0 < sum(diffs) / len(diffs) < 0.1 and max(diffs) < 1.0


def random_marian(tmp_path, share=True, tie=True, **overrides):
    """A randomly initialised MarianMTModel built by `transformers`, saved with a tokenizer.json of ours."""
    tok = tokenizer()
    V = tok.src_vocab_size
    cfg = dict(vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=1,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
               activation_function="relu", max_position_embeddings=64, scale_embedding=True, pad_token_id=0,
               eos_token_id=3, bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
               share_encoder_decoder_embeddings=share, tie_word_embeddings=tie)
    torch.manual_seed(1)
    hf = transformers.MarianMTModel(transformers.MarianConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make every one of them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.copy_(torch.rand_like(p) + 0.5 if "layer_norm.weight" in name else torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "marian")
    tok.tok.save(str(tmp_path / "marian" / "tokenizer.json"))
    return hf, tok


@pytest.mark.parametrize("share,tie", [(True, True), (False, True), (False, False)])
def test_random_marian_imports_with_the_logits_transformers_computes(share, tie, tmp_path):
    hf, tok = random_marian(tmp_path, share, tie)
    assert hf.model.encoder.layers[0].self_attn.k_proj.bias.abs().sum() > 0  # dropped on import: softmax ignores it
    model, tokenizer_, _ = __import__("transformer.training.components.checkpoint", fromlist=["load_model"]).load_model(
        tmp_path / "marian")  # a folder: imported
    assert model.args.tie_embeddings == ("all" if share else "decoder" if tie else "none")
    src, tgt_in = batch(tok)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt_in).logits
    torch.testing.assert_close(our_logits(model, src, tgt_in), theirs, atol=2e-5, rtol=1e-5)
    assert tokenizer_.encode_src_batch(SRC) == tok.encode_src_batch(SRC)


@pytest.mark.parametrize("overrides,message", [
    ({"activation_function": "gelu_new"}, "activation_function='gelu_new': model.activation has gelu, relu, swish"),
    ({"scale_embedding": False}, "scale_embedding=false"),
    ({"decoder_ffn_dim": 64}, "encoder_ffn_dim != decoder_ffn_dim"),
    ({"pad_token_id": 1, "decoder_start_token_id": 1, "eos_token_id": 0}, "pad/decoder start/eos ids 1/1/0"),
    ({"share": True, "tie": False}, "untied output layer"),
])
def test_what_does_not_map_is_refused_in_one_line(overrides, message, tmp_path, capsys):
    random_marian(tmp_path, **overrides)
    assert translate_cli.main([str(tmp_path / "marian"), "--beam", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transformer-translate: error: ") and message in err, err


@pytest.mark.parametrize("activation", ["swish", "gelu"])
def test_released_marian_switches_import_with_the_logits_transformers_computes(activation, tmp_path):
    """The activation and output bias of released Marian models become model.activation and model.output_bias."""
    hf, tok = random_marian(tmp_path, activation_function=activation)
    with torch.no_grad():
        hf.final_logits_bias.normal_()
    hf.save_pretrained(tmp_path / "marian")
    ckpt = import_hf(tmp_path / "marian")
    assert (ckpt["model_args"]["activation"], ckpt["model_args"]["output_bias"]) == (activation, True)
    model = Transformer(ModelArgs.from_dict(ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    src, tgt_in = batch(tok)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt_in).logits
    torch.testing.assert_close(our_logits(model.eval(), src, tgt_in), theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("ours,theirs", [("attention_dropout", "attention_dropout"),
                                         ("ffn_dropout", "activation_dropout")])
def test_own_dropout_rates_go_both_ways_with_marian_configs(tmp_path, ours, theirs):
    """A Marian config dropping 0.1 but nothing in attention, or after the feed-forward activation
    (MarianConfig's defaults), imports as model.attention_dropout=0.0 or model.ffn_dropout=0.0 (rates, which a
    fine-tuning run's config sets anew, as model.dropout); equal rates import as null; an exported model writes
    its own rate, or P_drop."""
    random_marian(tmp_path, dropout=0.1, **{theirs: 0.0})
    args = import_hf(tmp_path / "marian")["model_args"]
    assert (args["dropout"], args[ours]) == (0.1, 0.0)
    random_marian(tmp_path, dropout=0.1, **{theirs: 0.1})
    assert import_hf(tmp_path / "marian")["model_args"][ours] is None
    trained = trained_model(steps=1)  # dropout 0.0
    for rate, written in ((None, 0.0), (0.3, 0.3)):
        model = Transformer(dataclasses.replace(trained.args, **{ours: rate}))
        model.load_state_dict(trained.state_dict())
        export_hf(model, tokenizer(), {}, tmp_path / f"hf{rate}")
        cfg = json.loads((tmp_path / f"hf{rate}" / "config.json").read_text())
        assert (cfg["dropout"], cfg[theirs]) == (0.0, written)
        assert import_hf(tmp_path / f"hf{rate}")["model_args"][ours] == rate


def test_a_folder_without_a_model_or_tokenizer_is_refused(tmp_path):
    random_marian(tmp_path)
    (tmp_path / "marian" / "tokenizer.json").unlink()
    with pytest.raises(InteropError, match="no tokenizer.json"):
        import_hf(tmp_path / "marian")
    with pytest.raises(InteropError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_translate_reads_an_exported_folder_like_the_checkpoint(tmp_path, capsys, monkeypatch):
    model, tok = trained_model("all", True), tokenizer(True)
    atomic_save(checkpoint(model, tok), tmp_path / "m.pt")
    assert export_cli.main([str(tmp_path / "m.pt"), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    (tmp_path / "in.txt").write_text("\n".join(SRC) + "\n", encoding="utf-8")
    outputs = []
    for source in ("m.pt", "hf"):
        assert translate_cli.main([str(tmp_path / source), "--beam", "1", "--input", str(tmp_path / "in.txt")]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == len(SRC)


def spacy_checkpoint(path):
    itos = SPECIALS + ["ein", "mann", "a", "man"]
    tok = SpacyTokenizer("de", "en", Vocab(itos), Vocab(itos))
    torch.manual_seed(0)
    from transformer.config import ModelConfig
    model = Transformer.from_config(ModelConfig(N=1, d_model=16, d_ff=32, h=2), len(itos), len(itos))
    atomic_save(checkpoint(model, tok), path)


@pytest.mark.parametrize("argv,message", [
    (["--to", "hf"], "tokenizer=spacy: a Hugging Face export needs tokenizer=bpe or sentencepiece; spaCy's"),
    (["--to", "ctranslate2", "--quantization", "int8", "--out", "OUT/x"], "--out OUT/x: folder OUT does not exist"),
    (["--to", "hf", "--quantization", "int8"], "--quantization int8: only with --to ctranslate2"),
    (["--to", "ctranslate2", "--out", "CKPT"], "exists and is not an empty folder"),
])
def test_export_refuses_in_one_line_and_writes_nothing(argv, message, tmp_path, capsys):
    ckpt = tmp_path / "s.pt"
    spacy_checkpoint(ckpt)
    argv = [a.replace("OUT", str(tmp_path / "out")).replace("CKPT", str(ckpt)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    assert export_cli.main([str(ckpt), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transformer-export: error: ") and message.replace(
        "OUT", str(tmp_path / "out")) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]


def test_pre_norm_goes_to_ctranslate2_not_hf(tmp_path, capsys):
    model, tok = trained_model("decoder", True, True), tokenizer(True)
    atomic_save(checkpoint(model, tok), tmp_path / "m.pt")
    assert export_cli.main([str(tmp_path / "m.pt"), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "model.norm_first=true: MarianMTModel is post-norm" in capsys.readouterr().err
    assert export_cli.main([str(tmp_path / "m.pt"), "--to", "ctranslate2", "--out", str(tmp_path / "ct2")]) == 0
    assert json.loads((tmp_path / "ct2" / "config.json").read_text())["decoder_start_token"] == "<s>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "m.pt"]


def test_reading_a_folder_without_transformers_installed_is_one_line(tmp_path, monkeypatch):
    random_marian(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when not installed
    with pytest.raises(InteropError, match=r"needs the Python package transformers: pip install 'transformer\["):
        load_checkpoint(tmp_path / "marian")


def test_init_from_a_folder_refuses_a_config_asking_for_another_vocabulary(tmp_path, make_cfg):
    """trainer.init_from=DIR keeps the folder's tokenizer; a config asking for another size or kind is refused in
    one line naming both (the folder has no config: its tokenizer state says what it is)."""
    from transformer.config import ConfigError
    from transformer.training.components.init_from import prepare_init_from

    model, tok = trained_model("all", True), tokenizer(True)
    atomic_save(checkpoint(model, tok), tmp_path / "m.pt")
    assert export_cli.main([str(tmp_path / "m.pt"), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    size = tok.state_dict()
    arch = ["model.N=2", "model.N_dec=1", "model.d_model=32", "model.d_ff=64", "model.h=4", "model.dropout=0.0",
            "model.tie_embeddings=all", "model.max_positions=64"]
    ok = make_cfg("tokenizer=bpe", f"tokenizer.vocab_size={tok.src_vocab_size}", "tokenizer.tgt_vocab=seen",
                  f"trainer.init_from={tmp_path / 'hf'}", *arch)
    from transformer.cli.train import check
    check(ok)  # the command line's check takes a folder for trainer.init_from
    with pytest.raises(ConfigError, match="no such checkpoint file or Hugging Face model folder"):
        check(make_cfg(f"trainer.init_from={tmp_path / 'missing'}"))
    init = prepare_init_from(ok)
    # the model group must build the folder's model: one line lists the overrides that do, before any data work
    with pytest.raises(ConfigError, match=f"set {' '.join(arch[:3])} model.d_ff=64 .* \\(this config has model.N=6,"):
        prepare_init_from(make_cfg("tokenizer=bpe", f"tokenizer.vocab_size={tok.src_vocab_size}",
                                   "tokenizer.tgt_vocab=seen", f"trainer.init_from={tmp_path / 'hf'}"))
    assert init.tokenizer_state["json"] and init.tokenizer_state["n_tgt"] == size["n_tgt"]
    other = make_cfg("tokenizer=bpe", "tokenizer.vocab_size=6000", "tokenizer.tgt_vocab=seen",
                     f"trainer.init_from={tmp_path / 'hf'}")
    with pytest.raises(ConfigError, match=f"tokenizer.vocab_size=6000 \\(the checkpoint's: {tok.src_vocab_size}\\)"):
        prepare_init_from(other)
