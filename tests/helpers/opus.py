"""A fake released OPUS-MT folder, as Helsinki-NLP/opus-mt-de-en lays it out, built offline: two SentencePiece
models learnt from a few hundred Multi30k lines, vocab.json in Marian's order (</s>=0, <unk>=1, the pieces,
<pad> last), a MarianTokenizer saved by `transformers`, and a MarianMTModel with the released config (shrunk)."""
import gzip
import io
import itertools
import json
from pathlib import Path

import torch

from helpers.data import MULTI30K

LINES = 400


def multi30k_lines(n: int = LINES, split: str = "train"):
    """The first n (German, English) lines of a Multi30k split."""
    out = []
    for lang in ("de", "en"):
        with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
            out.append([line.rstrip("\n") for line in itertools.islice(f, n)])
    return out


def released_config(V: int, **overrides) -> dict:
    """opus-mt-de-en's config.json (transformers' MarianConfig keys), with a small model's sizes."""
    cfg = dict(vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
               activation_function="swish", scale_embedding=True, share_encoder_decoder_embeddings=True,
               static_position_embeddings=True, normalize_before=False, normalize_embedding=False,
               add_bias_logits=False, add_final_layer_norm=False, max_position_embeddings=512, dropout=0.1,
               attention_dropout=0.0, activation_dropout=0.0, pad_token_id=V - 1, eos_token_id=0, bos_token_id=0,
               decoder_start_token_id=V - 1, forced_eos_token_id=0, architectures=["MarianMTModel"])
    return {**cfg, **overrides}


def spm_model(texts, vocab_size: int) -> bytes:
    import sentencepiece
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=out, vocab_size=vocab_size,
                                             model_type="unigram", minloglevel=2, num_threads=1)
    return out.getvalue()


def fake_opus(folder: Path, vocab_size: int = 300, train_steps: int = 0, seed: int = 0, **overrides):
    """Writes `folder` as an OPUS-MT folder; returns (MarianMTModel in eval mode, MarianTokenizer). Every
    piece of both SentencePiece models is in vocab.json except a few of the target's (as in released models,
    whose vocab.json can lack pieces: they become <unk>). `train_steps`: Adam steps on the Multi30k lines,
    so that greedy outputs are sentences rather than one repeated piece."""
    import sentencepiece
    import transformers

    folder.mkdir(parents=True)
    de, en = multi30k_lines()
    vocab = {"</s>": 0, "<unk>": 1}
    for name, texts in (("source", de), ("target", en)):
        proto = spm_model(texts, vocab_size)
        (folder / f"{name}.spm").write_bytes(proto)
        sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_unknown(i) + sp.is_control(i) == 0]
        new = [p for p in pieces if p not in vocab]
        for p in new[:-3] if name == "target" else new:  # three target-only pieces left out
            vocab[p] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    tok = transformers.MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"),
                                       str(folder / "vocab.json"), source_lang="de", target_lang="en")
    tok.save_pretrained(folder)
    V = len(vocab)
    torch.manual_seed(seed)
    hf = transformers.MarianMTModel(transformers.MarianConfig(**released_config(V, **overrides)))
    with torch.no_grad():  # transformers initialises biases to 0, norms to 1 and <pad>'s row to 0: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.copy_(torch.rand_like(p) + 0.5 if "layer_norm.weight" in name else torch.randn_like(p) * 0.1)
        hf.model.shared.weight[V - 1].normal_(std=0.1)
        hf.final_logits_bias.normal_(std=0.5)
    if train_steps:
        train(hf, tok, de[:32], en[:32], train_steps)
    hf.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[V - 1]], bos_token_id=0, decoder_start_token_id=V - 1, eos_token_id=0, forced_eos_token_id=0,
        max_length=512, num_beams=4, pad_token_id=V - 1, renormalize_logits=True)
    hf.save_pretrained(folder)
    return hf.eval(), tok


def train(hf, tok, src, tgt, steps: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: thread hand-offs cost more than the maths
    try:
        _train(hf, tok, src, tgt, steps)
    finally:
        torch.set_num_threads(threads)


def _train(hf, tok, src, tgt, steps: int) -> None:
    batch = tok(src, text_target=tgt, return_tensors="pt", padding=True)
    labels = batch["labels"].masked_fill(batch["labels"] == hf.config.pad_token_id, -100)
    opt = torch.optim.Adam(hf.parameters(), lr=3e-3)
    hf.train()
    for _ in range(steps):
        loss = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    hf.eval()
