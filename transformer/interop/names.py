"""The one correspondence between this project's weight names and Hugging Face Marian's.

`Transformer.state_dict()` keys -> `MarianMTModel.state_dict()` keys, with the axes of each tensor that run
along the residual stream (d_model). Marian's sinusoidal table holds the sines in the first half of d_model
and the cosines in the second; ours interleaves them (sin, cos, sin, ...). The two models are the same
function once the residual stream's coordinates are permuted, so every residual axis is permuted on the
way out and back: exact, since layer norm, residual sums and the per-head split of q/k/v (which are
not residual axes) do not depend on the order of those coordinates.
"""
import re
from typing import Dict, Iterable, Optional, Tuple

import torch

from transformer.model.projections import split_projections

_L = r"(encoder|decoder)\.(\d+)\."
_HF_L = r"model.\1.layers.\2."
# (our key pattern, Marian key template, residual axes of the tensor)
TABLE = [
    (r"src_embed\.tokens\.weight", "model.encoder.embed_tokens.weight", (1,)),
    (r"tgt_embed\.tokens\.weight", "model.decoder.embed_tokens.weight", (1,)),
    (r"generator\.weight", "lm_head.weight", (1,)),
    (r"generator\.bias", "lm_head.bias", ()),  # Marian's final_logits_bias (1, rows): hf.py reshapes it
    (r"enc_norm\.(weight|bias)", r"model.encoder.layer_norm.\1", (0,)),
    (r"dec_norm\.(weight|bias)", r"model.decoder.layer_norm.\1", (0,)),
    (_L + r"self_attn\.([qkv])_proj\.weight", _HF_L + r"self_attn.\3_proj.weight", (1,)),
    (_L + r"self_attn\.([qv])_proj\.bias", _HF_L + r"self_attn.\3_proj.bias", ()),
    (_L + r"self_attn\.out_proj\.(weight|bias)", _HF_L + r"self_attn.out_proj.\3", (0,)),
    (r"decoder\.(\d+)\.cross_attn\.([qkv])_proj\.weight", r"model.decoder.layers.\1.encoder_attn.\2_proj.weight", (1,)),
    (r"decoder\.(\d+)\.cross_attn\.([qv])_proj\.bias", r"model.decoder.layers.\1.encoder_attn.\2_proj.bias", ()),
    (r"decoder\.(\d+)\.cross_attn\.out_proj\.(weight|bias)", r"model.decoder.layers.\1.encoder_attn.out_proj.\2", (0,)),
    (_L + r"ff\.w1\.weight", _HF_L + r"fc1.weight", (1,)),
    (_L + r"ff\.w1\.bias", _HF_L + r"fc1.bias", ()),
    (_L + r"ff\.w2\.(weight|bias)", _HF_L + r"fc2.\3", (0,)),
    (r"encoder\.(\d+)\.sub1\.norm\.(weight|bias)", r"model.encoder.layers.\1.self_attn_layer_norm.\2", (0,)),
    (r"encoder\.(\d+)\.sub2\.norm\.(weight|bias)", r"model.encoder.layers.\1.final_layer_norm.\2", (0,)),
    (r"decoder\.(\d+)\.sub1\.norm\.(weight|bias)", r"model.decoder.layers.\1.self_attn_layer_norm.\2", (0,)),
    (r"decoder\.(\d+)\.sub2\.norm\.(weight|bias)", r"model.decoder.layers.\1.encoder_attn_layer_norm.\2", (0,)),
    (r"decoder\.(\d+)\.sub3\.norm\.(weight|bias)", r"model.decoder.layers.\1.final_layer_norm.\2", (0,)),
]
_COMPILED = [(re.compile(p + r"\Z"), t, axes) for p, t, axes in TABLE]


def marian_name(key: str) -> Tuple[str, Tuple[int, ...]]:
    """Our key -> (Marian key, residual axes). A key the table lacks raises KeyError naming it."""
    for pattern, template, axes in _COMPILED:
        m = pattern.match(key)
        if m:
            return m.expand(template), axes
    raise KeyError(f"no Marian name for weight {key!r}")


def residual_permutation(d_model: int) -> torch.Tensor:
    """Marian coordinate j holds our coordinate perm[j]: the sines (our even coordinates), then the cosines."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _permute(t: torch.Tensor, axes: Iterable[int], index: torch.Tensor) -> torch.Tensor:
    for axis in axes:
        t = t.index_select(axis, index)
    return t.clone(memory_format=torch.contiguous_format)  # never a view of the source model's weights


def to_marian(state: Dict[str, torch.Tensor], d_model: int) -> Dict[str, torch.Tensor]:
    """Our state dict -> Marian's names and coordinates (keys Marian has and we lack, such as k_proj.bias,
    are the caller's). The stacked q/k/v and memory k/v projections are split first: TABLE names the
    separate-projection layout (`transformer.model.split_projections`)."""
    perm = residual_permutation(d_model)
    out = {}
    for key, t in split_projections(state).items():
        name, axes = marian_name(key)
        out[name] = _permute(t.detach().float(), axes, perm)
    return out


def from_marian(hf: Dict[str, torch.Tensor], our_keys: Iterable[str], d_model: int,
                missing: Optional[list] = None) -> Dict[str, torch.Tensor]:
    """Marian's state dict -> ours, for the keys `our_keys` (a freshly built model's `state_dict()` keys, in
    the separate-projection layout: `separate_keys`); the result is in that layout too, which the model's
    loader stacks (`fuse_projections`). Keys Marian lacks are appended to `missing` (or raise KeyError when it
    is None)."""
    inverse = torch.argsort(residual_permutation(d_model))
    out = {}
    for key in our_keys:
        name, axes = marian_name(key)
        if name not in hf:
            if missing is None:
                raise KeyError(f"the Marian weights lack {name} (our {key})")
            missing.append(name)
            continue
        out[key] = _permute(hf[name].detach().float(), axes, inverse)
    return out


def separate_keys(model) -> list:
    """A model's state-dict keys in the separate-projection layout TABLE names (q/k/v apart)."""
    return list(split_projections(model.state_dict(), views=True))
