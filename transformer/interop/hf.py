"""Hugging Face `MarianMTModel` directories: export of this project's checkpoints, import of such directories.

Marian in `transformers` is this model exactly when the model is post-norm: the same feed-forward
activation (model.activation), token embeddings scaled by sqrt(d_model), a sinusoidal table with the same
frequencies (laid out differently: `names.py` permutes the residual stream), key biases (ours has none: zeros,
which softmax ignores), and an output bias (model.output_bias, else zeros). What Marian cannot hold is refused
with one line (`export_refusal`, `import_hf`). The tokenizer goes as a fast tokenizer.json (tokenizer=bpe) or as
`MarianTokenizer`'s files (tokenizer=sentencepiece, and imported OPUS-MT models), which segment with sentencepiece.
"""
import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from transformer.atomic import temp_dir_beside
from transformer.checkpoint_files import FORMAT
from transformer.interop import InteropError, check_out_dir, replace_dir
from transformer.interop.names import from_marian, marian_name, separate_keys, to_marian
from transformer.interop.opus import (
    eval_settings,
    is_sentencepiece_folder,
    read_vocabulary,
    remap_rows,
    write_marian_tokenizer,
)
from transformer.model.projections import fuse_projections
from transformer.specials import BOS, EOS, PAD, SPECIALS, UNK

META_FILE = "transformer.json"  # what an export adds for this project's importer: languages, eval settings
# Marian weights with no counterpart here: recomputed tables, the shared copies of tied matrices, the key
# biases (softmax is unchanged by a bias added to every key of a query) and the output bias (checked apart).
_IGNORED_SUFFIXES = ("embed_positions.weight", "k_proj.bias")
_IGNORED = ("final_logits_bias", "model.shared.weight")
# transformers' activation_function names -> model.activation
HF_ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}


def export_refusal(args, tokenizer) -> Optional[str]:
    """Why a model (ModelArgs) and its tokenizer cannot become a MarianMTModel directory; None when they can."""
    name = getattr(tokenizer, "name", "?")
    if name not in ("bpe", "sentencepiece", "sentencepiece_pair"):
        why = {"spacy": "spaCy's rule-based tokenisation has no Hugging Face tokenizer equivalent (--to ctranslate2 "
                        "takes its vocabularies)",
               "copy": "the copy task's numbered symbols are no text (--to ctranslate2 takes them)"}
        return f"tokenizer={name}: a Hugging Face export needs tokenizer=bpe or sentencepiece; " + \
            why.get(name, "no Hugging Face tokenizer holds it")
    if args.norm_first:
        return ("model.norm_first=true: MarianMTModel is post-norm, and no standard Hugging Face translation "
                "class holds a pre-norm model with this position table exactly (--to ctranslate2 does)")
    if args.d_model % 2:
        return f"model.d_model={args.d_model}: Marian's sinusoidal table needs an even width"
    return None


def marian_config(args, dropout: Optional[float] = None):
    """The MarianConfig of a model with these ModelArgs."""
    from transformers import MarianConfig

    p = args.dropout if dropout is None else dropout
    attention = p if args.attention_dropout is None else args.attention_dropout
    ffn = p if args.ffn_dropout is None else args.ffn_dropout
    tgt_rows = args.src_vocab_size if args.tie_embeddings == "all" else args.tgt_vocab_size
    return MarianConfig(
        vocab_size=args.src_vocab_size, decoder_vocab_size=tgt_rows, d_model=args.d_model,
        encoder_layers=args.N, decoder_layers=args.N_dec, encoder_attention_heads=args.h,
        decoder_attention_heads=args.h, encoder_ffn_dim=args.d_ff, decoder_ffn_dim=args.d_ff,
        activation_function=args.activation, dropout=p, attention_dropout=attention, activation_dropout=ffn,
        max_position_embeddings=args.max_positions, scale_embedding=True,
        share_encoder_decoder_embeddings=args.tie_embeddings == "all",
        tie_word_embeddings=args.tie_embeddings in ("decoder", "all"),
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=None,
        architectures=["MarianMTModel"])


def marian_model(model, args=None):
    """A `transformers` MarianMTModel computing what `model` (a Transformer) computes, in eval mode."""
    from transformers import MarianMTModel

    args = args or model.args
    hf = MarianMTModel(marian_config(args))
    state = to_marian(model.state_dict(), args.d_model)
    for key, t in list(hf.state_dict().items()):
        if key.endswith("k_proj.bias"):
            state[key] = torch.zeros_like(t)
    bias = torch.zeros_like(hf.final_logits_bias)  # (1, rows)
    if args.output_bias:
        bias[0] = state.pop("lm_head.bias")
    # tokenizer.tgt_vocab=seen with a shared matrix: only the first tgt_vocab_size rows are outputs.
    bias[:, args.tgt_vocab_size:] = -float("inf")
    state["final_logits_bias"] = bias
    if args.tie_embeddings == "all":
        state["model.shared.weight"] = state["model.encoder.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("embed_positions.weight")]
    if missing or unexpected:
        raise InteropError(f"weights do not map onto MarianMTModel (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    return hf.eval()


def fast_tokenizer(tokenizer, max_positions: int):
    """The project's BPE tokenizer as a `transformers` fast tokenizer that appends </s> to a source, as the
    project's batches do."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tokenizer.tok.to_str())
    tok.post_processor = processors.TemplateProcessing(single=f"$A {SPECIALS[EOS]}",
                                                       special_tokens=[(SPECIALS[EOS], EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[PAD], unk_token=SPECIALS[UNK],
                                   bos_token=SPECIALS[BOS], eos_token=SPECIALS[EOS], model_max_length=max_positions)


def marian_pair(tokenizer):
    """A `tokenizer=sentencepiece` tokenizer as `MarianTokenizer`'s files hold it: its one model for both sides and
    vocab.json numbering each piece by its own id, so that `transformers` gives the project's ids (both segment
    with sentencepiece itself)."""
    from transformer.data.spm_pair import SentencePiecePairTokenizer

    pieces = tokenizer.src_tokens(range(tokenizer.src_vocab_size))
    return SentencePiecePairTokenizer(tokenizer.proto, tokenizer.proto, pieces,
                                      {SPECIALS[i]: i for i in (PAD, UNK, EOS)}, tokenizer.src_lang, tokenizer.tgt_lang)


def sentencepiece_state(path: Path, V: int, n_out: int, meta: dict) -> dict:
    """The `tokenizer=sentencepiece` state of a folder this project exported from one (META_FILE says so): its
    source.spm, which must also be target.spm and number vocab.json's V pieces with their own ids."""
    from transformer.data.spm import SentencePieceTokenizer

    what = f"{path}: {META_FILE} says tokenizer=sentencepiece, but"
    try:
        src, tgt = ((path / f).read_bytes() for f in ("source.spm", "target.spm"))
        tok = SentencePieceTokenizer(src, meta.get("src_lang", ""), meta.get("tgt_lang", ""), n_out)
    except (OSError, RuntimeError, ValueError) as e:
        raise InteropError(f"{what} source.spm does not load as this project's ({str(e).strip() or type(e).__name__})"
                           ) from None
    pieces = tok.src_tokens(range(tok.src_vocab_size))
    if src != tgt or _read_json(path / "vocab.json", "vocab.json") != {p: i for i, p in enumerate(pieces)} \
            or len(pieces) != V:
        raise InteropError(f"{what} source.spm, target.spm, vocab.json and config.json vocab_size={V} are not one "
                           "SentencePiece model numbered by its own ids")
    return tok.state_dict()


def export_hf(model, tokenizer, ckpt: dict, out) -> Path:
    """Writes `out` (a new or empty folder) as a MarianMTModel directory: config, generation settings (the
    checkpoint's eval settings), safetensors weights, fast tokenizer. Written beside `out`, then renamed."""
    out = Path(out)
    why = export_refusal(model.args, tokenizer)
    if why:
        raise InteropError(why)
    check_out_dir(out)
    from transformers import GenerationConfig

    from transformer.config import eval_from_dict

    ev = eval_from_dict((ckpt.get("config") or {}).get("eval"))
    lenpen = float((ckpt.get("decoding") or {}).get("lenpen", ev.lenpen))
    hf = marian_model(model)
    beam = {"num_beams": ev.beam, "length_penalty": lenpen, "early_stopping": True} if ev.beam > 1 else {}
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, forced_eos_token_id=None,
        max_length=model.args.max_positions, suppress_tokens=[PAD, BOS], **beam)  # never output by the project
    tmp = temp_dir_beside(out)  # not mkdtemp's 0700: the umask's mode, as every file written
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        if tokenizer.name == "sentencepiece_pair":  # an imported OPUS-MT model: MarianTokenizer's files again
            write_marian_tokenizer(tokenizer, tmp, model.args.max_positions)
        elif tokenizer.name == "sentencepiece":
            write_marian_tokenizer(marian_pair(tokenizer), tmp, model.args.max_positions)
        else:
            fast_tokenizer(tokenizer, model.args.max_positions).save_pretrained(tmp)
        meta = {"tokenizer": tokenizer.name, "src_lang": tokenizer.src_lang, "tgt_lang": tokenizer.tgt_lang,
                "tgt_vocab_size": model.args.tgt_vocab_size, "eval": (ckpt.get("config") or {}).get("eval"),
                "lenpen": lenpen}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InteropError(f"{path}: unreadable {what} ({e})") from None


def _import_refusal(cfg: dict, fixed_ids: bool = True) -> Optional[str]:
    """Why a Marian config.json describes a model this project's Transformer cannot be; None when it can.
    `fixed_ids`: the folder's tokenizer.json must already number <pad> <s> </s> as this project does (a
    SentencePiece folder is renumbered on import instead: opus.py)."""
    if cfg.get("model_type") != "marian":
        return f"model_type={cfg.get('model_type')!r}: only Hugging Face MarianMTModel directories are imported"
    checks = [
        (cfg.get("activation_function", "gelu") in HF_ACTIVATIONS,
         f"activation_function={cfg.get('activation_function')!r}: model.activation has "
         f"{', '.join(sorted(set(HF_ACTIVATIONS.values())))}"),
        (cfg.get("scale_embedding", False), "scale_embedding=false: this project scales embeddings by sqrt(d_model)"),
        (cfg.get("encoder_attention_heads") == cfg.get("decoder_attention_heads"),
         "encoder_attention_heads != decoder_attention_heads: one head count here (model.h)"),
        (cfg.get("encoder_ffn_dim") == cfg.get("decoder_ffn_dim"),
         "encoder_ffn_dim != decoder_ffn_dim: one feed-forward width here (model.d_ff)"),
        (not cfg.get("normalize_before", False), "normalize_before=true: Marian here is post-norm"),
        (not fixed_ids or (cfg.get("pad_token_id") == PAD and cfg.get("decoder_start_token_id") == BOS
                           and cfg.get("eos_token_id") == EOS),
         f"pad/decoder start/eos ids {cfg.get('pad_token_id')}/{cfg.get('decoder_start_token_id')}/"
         f"{cfg.get('eos_token_id')}: a tokenizer.json must number them {PAD}/{BOS}/{EOS} (<pad> <unk> <s> </s> "
         "first); a MarianTokenizer folder (source.spm, target.spm, vocab.json) is renumbered on import"),
    ]
    return next((why for ok, why in checks if not ok), None)


def _own_dropout(cfg: dict, key: str) -> Optional[float]:
    """model.attention_dropout (key attention_dropout) or model.ffn_dropout (activation_dropout) of a Marian
    config: null where it equals `dropout` (this project's default), its own rate otherwise (MarianConfig's
    defaults: 0.0 there, 0.1 elsewhere)."""
    rate = cfg.get(key)
    return None if rate is None or float(rate) == float(cfg["dropout"]) else float(rate)


def _output_rows(bias: torch.Tensor) -> int:
    """How many leading output rows are real: the rest carry -inf (an exported tgt_vocab=seen model)."""
    finite = torch.isfinite(bias)
    n = int(finite.sum())
    if not bool(finite[:n].all()) or bool((bias[n:] != -float("inf")).any()):
        raise InteropError("final_logits_bias mixes finite and -inf values: not an output restriction this imports")
    return n


def import_hf(path) -> dict:
    """A MarianMTModel directory -> a checkpoint-shaped dict ("format", "model_args", "model", "tokenizer",
    "config") that this project's loaders take. Refuses, with one line, what does not map."""
    from transformer.model import ModelArgs, Transformer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InteropError(f"{path}: a folder, but not a Hugging Face model (no config.json)")
    cfg = _read_json(path / "config.json", "config.json")
    meta = _read_json(path / META_FILE, META_FILE) if (path / META_FILE).is_file() else {}
    spm = is_sentencepiece_folder(path)
    own_spm = spm and meta.get("tokenizer") == "sentencepiece"  # exported from tokenizer=sentencepiece: our ids
    spm = spm and not own_spm  # renumbered from Marian's order
    why = _import_refusal(cfg, fixed_ids=not spm)
    if why:
        raise InteropError(f"{path}: {why}")
    if spm:  # a released OPUS-MT folder: Marian's vocabulary order and SentencePiece files
        tok_state, rows, never = read_vocabulary(path, cfg)
    elif own_spm:
        pass  # its state once the output rows are known
    elif not (path / "tokenizer.json").is_file():
        raise InteropError(f"{path}: no tokenizer.json (a fast tokenizer), nor MarianTokenizer's source.spm, "
                           "target.spm and vocab.json")
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        for i, s in enumerate(SPECIALS):
            if tok.token_to_id(s) != i:
                raise InteropError(f"{path}: tokenizer.json has {s} at id {tok.token_to_id(s)}, this project needs {i}")
    try:
        from transformers import MarianMTModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise InteropError(f"{path}: reading a Hugging Face model needs the Python package transformers: "
                           "pip install 'transformer[export]'") from None
    hf_logging.disable_progress_bar()
    try:
        hf_state = MarianMTModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).state_dict()
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InteropError(f"{path}: MarianMTModel weights do not load ({first})") from None
    if spm:
        hf_state = remap_rows(hf_state, rows, never)
    share = cfg.get("share_encoder_decoder_embeddings", True)
    tied = cfg.get("tie_word_embeddings", True)
    if share and not tied:
        raise InteropError(f"{path}: shared encoder/decoder embeddings with an untied output layer: here the "
                           "shared matrix is also the output layer (model.tie_embeddings=all)")
    V = len(rows) if spm else int(cfg["vocab_size"])
    if not spm and not own_spm and tok.get_vocab_size() != V:
        raise InteropError(f"{path}: tokenizer.json has {tok.get_vocab_size()} types, config.json vocab_size={V}")
    bias = hf_state["final_logits_bias"].flatten().float()
    n_out = _output_rows(bias)
    if own_spm:
        tok_state = sentencepiece_state(path, V, n_out, meta)
    elif spm and n_out < V:
        raise InteropError(f"{path}: final_logits_bias leaves {V - n_out} of {V} rows unscored "
                           f"(tokenizer.tgt_vocab=seen), which MarianTokenizer's files cannot say without the "
                           f"{META_FILE} of this project's export")
    args = ModelArgs(N=cfg["encoder_layers"], N_dec=cfg["decoder_layers"], d_model=cfg["d_model"],
                     d_ff=cfg["encoder_ffn_dim"], h=cfg["encoder_attention_heads"], dropout=float(cfg["dropout"]),
                     norm_first=False, tie_embeddings="all" if share else "decoder" if tied else "none",
                     max_positions=cfg["max_position_embeddings"], src_vocab_size=V, tgt_vocab_size=n_out,
                     shared_vocab=True, activation=HF_ACTIVATIONS[cfg.get("activation_function", "gelu")],
                     output_bias=bool((bias[:n_out] != 0).any()) or bool(spm and never),
                     attention_dropout=_own_dropout(cfg, "attention_dropout"),
                     ffn_dropout=_own_dropout(cfg, "activation_dropout"))
    with torch.device("meta"):
        keys = separate_keys(Transformer(args))
    state = fuse_projections(from_marian(hf_state, [k for k in keys if k != "generator.bias"], args.d_model))
    if args.output_bias:  # rows past n_out (never scored) carry -inf in Marian, zeros here
        state["generator.bias"] = torch.where(torch.isfinite(bias), bias, torch.zeros_like(bias))
    used = ({k for k in hf_state if k.endswith(_IGNORED_SUFFIXES) or k in _IGNORED}
            | {marian_name(k)[0] for k in keys if k != "generator.bias"})
    extra = sorted(set(hf_state) - used)
    if extra:
        raise InteropError(f"{path}: weights with no counterpart here: {', '.join(extra[:3])}")
    if not spm and not own_spm:
        tok.post_processor = None  # the project's batches add </s> themselves
        tok_state = {"name": "bpe", "src_lang": meta.get("src_lang", ""), "tgt_lang": meta.get("tgt_lang", ""),
                     "json": tok.to_str()}
        if n_out < V:
            tok_state["n_tgt"] = n_out
    if spm and not meta.get("eval"):  # a released folder: its own generation defaults (beam 4 for OPUS-MT)
        meta["eval"] = eval_settings(path, cfg)
    config = {"eval": meta["eval"]} if meta.get("eval") else {}
    return {"format": FORMAT, "model_args": args.to_dict(), "model": state, "tokenizer": tok_state,
            "config": config, "imported_from": str(path)}

