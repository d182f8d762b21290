"""CTranslate2 models, built with its specification API from this project's model (pre-norm and post-norm,
every tie_embeddings choice, the position table as this project computes it).

A CTranslate2 translator works on token strings: a source is its tokens plus "</s>" (the project's batches
append it), and outputs start from "<s>". The exported folder also holds the tokenizer: tokenizer.json
(tokenizer=bpe, loadable with `tokenizers`), sentencepiece.model (tokenizer=sentencepiece: its pieces are the
vocabulary's strings, its ids ours), source.spm and target.spm (an imported OPUS-MT model), and always the
project's tokenizer state (transformer_tokenizer.json).
"""
import json
import math
import shutil
from pathlib import Path
from typing import List, Optional

import torch

from transformer.atomic import temp_dir_beside
from transformer.interop import InteropError, check_out_dir, replace_dir
from transformer.model.projections import split_projections
from transformer.model.transformer import sinusoidal_positions
from transformer.specials import BOS, EOS, SPECIALS, UNK

QUANTIZATIONS = ("int8", "int8_float16", "float16")
# Tokens a CTranslate2 search must never output, as the project's search never does.
SUPPRESSED = [[SPECIALS[0]], [SPECIALS[BOS]]]


def _vocabularies(tokenizer, args):
    """(source tokens, target tokens): id k's string at position k; the target side stops at the rows the
    output layer scores (tgt_vocab_size)."""
    if getattr(tokenizer, "name", None) == "spacy":
        src, tgt = list(tokenizer.src_vocab.itos), list(tokenizer.tgt_vocab.itos)
    elif getattr(tokenizer, "name", None) == "bpe":
        src = tgt = [tokenizer.tok.id_to_token(i) for i in range(tokenizer.tok.get_vocab_size())]
    elif getattr(tokenizer, "name", None) == "sentencepiece":  # the model's own pieces, by id
        src = tgt = tokenizer.src_tokens(range(tokenizer.src_vocab_size))
    elif getattr(tokenizer, "name", None) == "sentencepiece_pair":  # an imported OPUS-MT model
        src = tgt = list(tokenizer.pieces)
    else:
        raise InteropError(f"tokenizer={getattr(tokenizer, 'name', '?')}: CTranslate2 export needs bpe, "
                           "sentencepiece, spacy or sentencepiece_pair")
    if len(set(src)) != len(src) or len(set(tgt)) != len(tgt):
        raise InteropError("the vocabulary has two types with the same string: CTranslate2 looks tokens up by string")
    return src[:args.src_vocab_size], tgt[:args.tgt_vocab_size]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy on the CPU: CTranslate2's quantisation scales its arrays in place, which must not reach the
    model (whose weights may be on a GPU: validation's eval.backend=ctranslate2)."""
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()


def _linear(spec, *layers) -> None:
    """spec <- the Linear layers stacked along their outputs (q, k, v fused as CTranslate2 expects); a layer
    without bias (the key projection) contributes zeros."""
    spec.weight = _copy(torch.cat([m.weight for m in layers]))
    spec.bias = _copy(torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers]))


def _norm(spec, ln) -> None:
    spec.gamma, spec.beta = _copy(ln.weight), _copy(ln.bias)


class _Part:
    """One projection of the separate-projection layout (`split_projections`), shaped like an nn.Linear."""

    def __init__(self, state: dict, name: str):
        self.weight, self.bias = state[f"{name}.weight"], state.get(f"{name}.bias")
        self.out_features = self.weight.size(0)


def _attention(spec, parts: dict, at: str, self_attention: bool) -> None:
    """`at`: the attention's state-dict prefix (e.g. decoder.0.cross_attn) in `parts`, a split state dict."""
    q, k, v, out = (_Part(parts, f"{at}.{p}") for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
    if self_attention:
        _linear(spec.linear[0], q, k, v)
    else:
        _linear(spec.linear[0], q)
        _linear(spec.linear[1], k, v)
    _linear(spec.linear[-1], out)


def _stack(spec, model, side: str, embedding, rows: int) -> None:
    a = model.args
    emb_spec = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    emb_spec.weight = _copy(embedding.tokens.weight[:rows])
    # A number, not True: a float16 export would turn True into a factor of 1.0.
    spec.scale_embeddings = math.sqrt(a.d_model)
    spec.position_encodings.encodings = sinusoidal_positions(a.max_positions, a.d_model)
    if a.norm_first:
        _norm(spec.layer_norm, model.enc_norm if side == "encoder" else model.dec_norm)
    layers = model.encoder if side == "encoder" else model.decoder
    parts = split_projections(model.state_dict(), views=True)  # q, k, v apart, as CTranslate2 names them
    for i, (ls, layer) in enumerate(zip(spec.layer, layers, strict=True)):
        _attention(ls.self_attention, parts, f"{side}.{i}.self_attn", True)
        _norm(ls.self_attention.layer_norm, layer.sub1.norm)
        if side == "decoder":
            _attention(ls.attention, parts, f"{side}.{i}.cross_attn", False)
            _norm(ls.attention.layer_norm, layer.sub2.norm)
        _linear(ls.ffn.linear_0, layer.ff.w1)
        _linear(ls.ffn.linear_1, layer.ff.w2)
        _norm(ls.ffn.layer_norm, (layer.sub3 if side == "decoder" else layer.sub2).norm)


def ct2_spec(model, tokenizer):
    """The CTranslate2 TransformerSpec of `model` (a Transformer) with its vocabularies registered."""
    from ctranslate2.specs import common_spec, transformer_spec

    a = model.args
    activation = {"relu": common_spec.Activation.RELU, "swish": common_spec.Activation.SWISH,
                  "gelu": common_spec.Activation.GELU}[a.activation]
    spec = transformer_spec.TransformerSpec.from_config((a.N, a.N_dec), a.h, pre_norm=a.norm_first,
                                                        activation=activation)
    _stack(spec.encoder, model, "encoder", model.src_embed, a.src_vocab_size)
    _stack(spec.decoder, model, "decoder", model.tgt_embed, a.tgt_vocab_size)
    spec.decoder.projection.weight = _copy(model.generator.weight[:a.tgt_vocab_size])
    if model.generator.bias is not None:
        spec.decoder.projection.bias = _copy(model.generator.bias[:a.tgt_vocab_size])
    src, tgt = _vocabularies(tokenizer, a)
    spec.register_source_vocabulary(src)
    spec.register_target_vocabulary(tgt)
    spec.config.bos_token, spec.config.eos_token = SPECIALS[BOS], SPECIALS[EOS]
    spec.config.unk_token, spec.config.decoder_start_token = SPECIALS[UNK], SPECIALS[BOS]
    return spec


def export_ct2(model, tokenizer, out, quantization: Optional[str] = None) -> Path:
    """Writes `out` (a new or empty folder) as a CTranslate2 model, weights in `quantization` (None: float32),
    plus the tokenizer. Written beside `out`, then renamed."""
    out = Path(out)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise InteropError(f"--quantization {quantization}: must be one of {', '.join(QUANTIZATIONS)}")
    check_out_dir(out)
    spec = ct2_spec(model, tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    tmp = temp_dir_beside(out)  # not mkdtemp's 0700: the umask's mode, as every file written
    try:
        spec.save(str(tmp))
        if tokenizer.name in ("bpe", "sentencepiece", "sentencepiece_pair"):
            tokenizer.save(tmp)
        (tmp / "transformer_tokenizer.json").write_text(json.dumps(tokenizer.state_dict(), ensure_ascii=False),
                                                        encoding="utf-8")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def source_tokens(tokenizer, texts) -> List[List[str]]:
    """What a CTranslate2 translator takes for raw sentences: each source's tokens and "</s>"."""
    from transformer.data.tokenizer import encode_sources
    return [tokenizer.src_tokens(ids) + [SPECIALS[EOS]] for ids in encode_sources(tokenizer, texts)]
