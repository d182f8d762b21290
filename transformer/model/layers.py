"""Building blocks of the Transformer (paper Section 3): attention, feed-forward, encoder and decoder layers."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from transformer.experimental.varlen import VarlenMask, varlen_attention
from transformer.model.dropout import Dropout, keep_mask, uses_keep_mask
from transformer.model.projections import StackedLinear
from transformer.model.residual import dropout_add, dropout_add_norm, norm_to, stream_dtype


def no_cudnn_attention(device: torch.device) -> None:
    """Attention through flash or memory-efficient kernels, not cuDNN's. Token-bucketed batches (and each
    decoding step) bring a new (B, T, S) shape, and cuDNN's SDPA builds an execution plan for every new
    shape on the host, which costs far more than its kernels (docs/benchmarks/switches.md)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h parallel scaled dot-product attentions over d_k = d_model / h dimensions.

    Self-attention projects its input to queries, keys and values in one product (`qkv_proj`, a StackedLinear);
    cross-attention (`self_attention=False`) projects only the queries and takes the keys/values of the encoder
    output precomputed for all decoder layers at once (`Transformer.memory_kv_of_layers`, `project_memory`).
    A mask is boolean, True where a query may attend to a key, or additive (0 or -inf in the queries' dtype:
    the source padding mask, `padding_bias`), broadcastable to (B, h, T, S).
    The fused `scaled_dot_product_attention` picks flash/memory-efficient kernels where it can; a padding
    mask (the encoder's self-attention, every cross-attention) keeps it off the flash kernel.
    With `keep_attention = True` the weights are computed explicitly and kept in `last_attention`
    (B, h, T, S) for plots.
    """

    def __init__(self, d_model: int, h: int, dropout: float, self_attention: bool = True):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        if self_attention:
            # No key bias: it adds the same q.b to every score of a query, which softmax ignores. Its true
            # gradient is zero, so Adam would only amplify rounding noise in it.
            self.qkv_proj = StackedLinear(d_model, d_model, biased=(True, False, True))
        else:
            self.q_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.keep_attention = False
        self.last_attention: Optional[torch.Tensor] = None

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

    def project_qkv(self, x: torch.Tensor):
        """Queries, keys and values of `x` (B, T, d_model), each (B, h, T, d_k), from one product."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, self.h, self.d_k)  # (B, T, 3, h, d_k)
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, h, T, d_k)

    def forward(self, query: torch.Tensor, kv: Optional[torch.Tensor] = None, mask=None,
                is_causal: bool = False, cache=None) -> torch.Tensor:
        """query (B, T, d_model). Self-attention: keys/values from `query`; cross-attention: `kv`, keys and values
        (B, h, S, d_k) each, as a pair or stacked (2, B, h, S, d_k).
        `cache` (decoder self-attention while decoding, a `LayerCache`) holds the keys/values of earlier positions
        and is extended in place, so each new token costs one row of attention instead of the whole prefix."""
        if isinstance(mask, VarlenMask):  # packed rows (transformer/experimental/varlen.py)
            return self._forward_packed(query, kv, mask, is_causal)
        B, T, _ = query.shape
        if kv is None:
            q, k, v = self.project_qkv(query)  # (B, h, T, d_k)
        else:
            q, (k, v) = self.split_heads(self.q_proj(query)), kv  # (B, h, T, d_k), (B, h, S, d_k)
        if cache is not None:
            k, v = cache.append(k, v)  # written into the cache in place -> (B, h, S, d_k) all positions
            if T > 1:  # several new positions at once: causal among themselves, all of the cache visible
                S = k.size(2)
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            is_causal = False  # one new query may see every cached key
        out = self._attend(q, k, v, mask, is_causal, self.dropout if self.training else 0.0)  # (B, h, T, d_k)
        out = out.transpose(1, 2).reshape(B, T, self.h * self.d_k)  # (B, T, d_model)
        return self.out_proj(out)

    def _forward_packed(self, x: torch.Tensor, kv: Optional[torch.Tensor], mask: VarlenMask,
                        is_causal: bool) -> torch.Tensor:
        """x (N_q, d_model), the real tokens of a batch packed; cross-attention's kv: keys and values
        (N_k, h, d_k) each."""
        N = x.size(0)
        if kv is None:
            q, k, v = self.qkv_proj(x).view(N, 3, self.h, self.d_k).unbind(1)  # 3 x (N, h, d_k)
        else:
            q, (k, v) = self.q_proj(x).view(N, self.h, self.d_k), kv
        out = varlen_attention(q, k, v, mask, is_causal, self.dropout if self.training else 0.0, self._attend)
        return self.out_proj(out.reshape(N, self.h * self.d_k))  # (N_q, d_model)

    def _attend(self, q, k, v, mask, is_causal: bool, p: float) -> torch.Tensor:
        """Equation (1) on (B, h, T, d_k) queries and (B, h, S, d_k) keys/values, dropout p on the weights."""
        if self.keep_attention:
            return self._explicit_attention(q, k, v, mask, is_causal)
        if p > 0 and uses_keep_mask(q):
            return _cpu_dropout_attention(q, k, v, mask, is_causal, p)
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            return _cpu_fp32_attention(q, k, v, mask, is_causal, p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)

    def _explicit_attention(self, q, k, v, mask, is_causal):
        """softmax(Q K^T / sqrt(d_k)) V, Equation (1), keeping the weights (no dropout: used at inference)."""
        weights = attention_weights(q, k, mask, is_causal)
        self.last_attention = weights.detach()
        return weights @ v


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask, is_causal: bool) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k)) of Equation (1): q (B, h, T, d_k), k (B, h, S, d_k) -> (B, h, T, S)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, h, T, S)
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(dim=-1)


def padding_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """keep (B, S) bool, True at real tokens -> (B, 1, 1, S) additive mask in `dtype`: 0 where a key may be
    attended, -inf at padding, its rows 8-aligned in memory.

    Given a boolean mask, SDPA converts it to this form in every call (three operations; a base model's
    forward has 12 such calls), and on CUDA its memory-efficient kernel first pads a copy of a mask whose rows
    are not 8-aligned. Made once a batch in the queries' dtype, as SDPA requires, neither happens."""
    B, S = keep.shape
    # Rows of (S // 8 + 1) * 8, never exactly S: a row stride that equals S for some lengths and not for others
    # would make torch.compile, whose lengths are dynamic, specialise on it and compile again.
    bias = torch.zeros(B, 1, 1, (S // 8 + 1) * 8, dtype=dtype, device=keep.device)
    bias[..., :S].masked_fill_(~keep[:, None, None, :], float("-inf"))
    return bias[..., :S]  # (B, 1, 1, S), row stride a multiple of 8


def _cpu_dropout_attention(q, k, v, mask, is_causal: bool, p: float) -> torch.Tensor:
    """Equation (1) with dropout on the weights (Section 5.4), as SDPA computes it on a CPU, but with the cheap
    dropout mask of transformer/model/dropout.py. With dropout, SDPA on a CPU takes its math path, which draws
    one Bernoulli sample per weight, at a cost docs/benchmarks/code-choices.md gives. Like that
    path, products and softmax run in fp32 whatever the input dtype (autocast off), and the result returns to it.
    q (B, h, T, d_k), k and v (B, h, S, d_k) -> (B, h, T, d_k)."""
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 (gradcheck)
    with torch.autocast("cpu", enabled=False):
        weights = attention_weights(q.to(compute), k.to(compute), mask, is_causal)
        weights = weights * keep_mask(weights.shape, p, weights.dtype)
        return (weights @ v.to(compute)).to(v.dtype)


def _cpu_fp32_attention(q, k, v, mask, is_causal: bool, p: float) -> torch.Tensor:
    """Equation (1) through SDPA in fp32 for bf16 inputs on a CPU, the result back in bf16. torch's CPU flash
    kernel's backward is several times slower in bf16 than in fp32 at this project's shapes (d_k 32, tens of
    positions), more than the attention's share of the step gains from bf16 (docs/benchmarks/2026-12-02-cpu-bf16.md);
    the casts of q, k, v and the output are small next to the products of the projections.
    q (B, h, T, d_k), k and v (B, h, S, d_k) -> (B, h, T, d_k)."""
    if mask is not None and mask.dtype != torch.bool:  # the additive padding bias, in bf16: in fp32, rows 8-aligned
        S = mask.size(-1)  # as `padding_bias` makes them
        mask = mask.new_empty(*mask.shape[:-1], (S // 8 + 1) * 8, dtype=torch.float32)[..., :S].copy_(mask)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=p,
                                             is_causal=is_causal)
    return out.to(q.dtype)


ACTIVATIONS = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2 (relu; swish or gelu with model.activation)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu"):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(self.act(self.w1(x))))


class SublayerConnection(nn.Module):
    """Residual connection around a sublayer with dropout (Section 5.4) and layer norm.

    Post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-norm (Annotated Transformer, easier to train deep): x + Dropout(Sublayer(LayerNorm(x))).
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool, bf16_residual: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first
        self.bf16_residual = bf16_residual  # ModelOptions.bf16_residual: the stream in bf16 under bf16 autocast

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        dtype = stream_dtype(x) if self.bf16_residual else None
        if dtype is not None:  # transformer/model/residual.py: one fused function under torch.compile
            if self.norm_first:
                return dropout_add(x, sublayer(norm_to(self.norm, x, dtype)), self.dropout, dtype)
            return dropout_add_norm(x, sublayer(x), self.dropout, self.norm, dtype)
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention, then a position-wise feed-forward network."""

    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float, norm_first: bool, activation: str = "relu",
                 bf16_residual: bool = False):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, h, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.sub1 = SublayerConnection(d_model, dropout, norm_first, bf16_residual)
        self.sub2 = SublayerConnection(d_model, dropout, norm_first, bf16_residual)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.sub1(x, lambda y: self.self_attn(y, mask=src_mask))
        return self.sub2(x, self.ff)


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, attention over the encoder output, feed-forward."""

    def __init__(self, d_model: int, d_ff: int, h: int, dropout: float, norm_first: bool, activation: str = "relu",
                 bf16_residual: bool = False):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, h, dropout)
        self.cross_attn = MultiHeadAttention(d_model, h, dropout, self_attention=False)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.sub1 = SublayerConnection(d_model, dropout, norm_first, bf16_residual)
        self.sub2 = SublayerConnection(d_model, dropout, norm_first, bf16_residual)
        self.sub3 = SublayerConnection(d_model, dropout, norm_first, bf16_residual)

    def forward(self, x: torch.Tensor, memory_kv, src_mask,
                cache=None, tgt_mask: Optional[VarlenMask] = None) -> torch.Tensor:
        """x (B, T, d_model); memory_kv: this layer's keys and values of the encoder output, (B, h, S, d_k)
        each, a pair (training) or stacked (2, B, h, S, d_k) (the decoding cache). Packed (Transformer.forward
        with unpadded attention): x (N_t, d_model), memory_kv a pair of (N_s, h, d_k), and src_mask and
        tgt_mask the VarlenMasks of cross- and self-attention."""
        # Right padding: a real target position never sees a pad position under the causal mask,
        # so the causal mask alone suffices (and lets SDPA use its fused causal kernels).
        x = self.sub1(x, lambda y: self.self_attn(y, mask=tgt_mask, is_causal=True, cache=cache))
        x = self.sub2(x, lambda y: self.cross_attn(y, kv=memory_kv, mask=src_mask))
        return self.sub3(x, self.ff)
