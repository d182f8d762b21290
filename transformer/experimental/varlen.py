"""Unpadded attention (`trainer.unpadded_attention`): the real tokens of a batch packed end to end, the sentences
told apart by cumulative lengths (`cu_seqlens`), so no position is computed for padding and no boolean mask
keeps the fused attention off its flash kernel.

`Transformer.forward` packs the source and target tokens once (or takes the packings that the loader's collate
made on the host, `host_packing`, which travel with the Batch: then no step reads a device value); embeddings,
Linear maps, LayerNorms and the feed-forward networks are per token and run on the packed (N, d_model) rows;
attention takes a `VarlenMask` (the packing of its queries and of its keys) and calls, in this order of preference
(the two CUDA kernels for fp16 and bf16 queries only: both are flash kernels):
  - flash-attn's `flash_attn_varlen_func` (the optional flash-attn package, CUDA): attention dropout included;
  - torch's `torch.nn.attention.varlen.varlen_attn` (CUDA), which has no dropout: only where P_drop is 0
    (or in eval mode);
  - the reference: the rows put back in padded (B, h, T, d_k) form and the padded path's own attention
    (SDPA with the key mask, or the CPU dropout path), then packed again. It is what CPUs run, and the
    equality of outputs and gradients with the padded model is what the tests check.
"""
import inspect
from typing import NamedTuple, Optional

import numpy as np
import torch

# The CUDA kernels, imported by load_kernels() when a model turns unpadded attention on, not with this module:
# importing torch.nn.attention.varlen imports torch._dynamo, which slowed every command's start (figure:
# docs/benchmarks/code-choices.md, "Figures behind code choices").
flash_attn_varlen_func = None  # optional: pip install flash-attn (CUDA builds only)
torch_varlen_attn, WINDOWED = None, False  # torch >= 2.10's; 2.10's takes `is_causal`, later ones `window_size`
_loaded = False


def load_kernels() -> None:
    """Import the varlen kernels this machine has (once; a Transformer built with
    `ModelOptions(unpadded_attention=True)` calls it)."""
    global flash_attn_varlen_func, torch_varlen_attn, WINDOWED, _loaded
    if _loaded:
        return
    _loaded = True
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # pragma: no cover - depends on the machine
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn
        WINDOWED = "window_size" in inspect.signature(torch_varlen_attn).parameters
    except ImportError:  # pragma: no cover - torch < 2.10
        pass


class Packing(NamedTuple):
    """Where the real tokens of a right-padded (B, T) batch sit once packed."""
    index: torch.Tensor  # (N,) each real token's position in the flattened (B*T) batch
    cu_seqlens: torch.Tensor  # (B+1,) int32: sentence b is rows [cu[b], cu[b+1]) of the packing
    lengths: torch.Tensor  # (B,)
    max_len: int
    B: int
    T: int

    def to(self, device: torch.device, non_blocking: bool = False) -> "Packing":
        return self._replace(**{k: getattr(self, k).to(device, non_blocking=non_blocking) for k in _TENSORS})

    def pin_memory(self) -> "Packing":
        return self._replace(**{k: getattr(self, k).pin_memory() for k in _TENSORS})

    def fit(self, B: int, T: int) -> "Packing":
        """This packing for the batch padded further to (B, T) (trainer.pad_to_multiple, static shapes): the
        same real tokens, their flat positions recomputed on the device, without a host sync."""
        compiling = torch.compiler.is_compiling()
        if not compiling and (B, T) == (self.B, self.T):
            return self
        if B < self.B or T < self.T:
            raise ValueError(f"a packing of a ({self.B}, {self.T}) batch cannot describe a ({B}, {T}) one")
        # Under torch.compile the same arithmetic whatever the sizes: a branch on them would be a guard, and a
        # recompilation for each combination of padded and unpadded sides.
        index = self.index if not compiling and T == self.T else self.index // self.T * T + self.index % self.T
        lengths, cu = self.lengths, self.cu_seqlens
        if compiling or B > self.B:  # rows of padding only: empty sentences at the end
            lengths = torch.cat([lengths, lengths.new_zeros(B - self.B)])
            cu = torch.cat([cu, cu[-1:].expand(B - self.B)])
        return Packing(index, cu, lengths, self.max_len, B, T)


_TENSORS = ("index", "cu_seqlens", "lengths")

class VarlenMask(NamedTuple):
    """Passed as an attention's `mask`: the packing of its queries and that of its keys."""
    q: Packing
    k: Packing


def packing(real: torch.Tensor) -> Packing:
    """real (B, T) bool, True at real tokens, which come first in every row (right padding)."""
    B, T = real.shape
    lengths = real.sum(dim=1)  # (B,)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=real.device)
    cu[1:] = lengths.cumsum(0)
    return Packing(real.flatten().nonzero().squeeze(1), cu, lengths, int(lengths.max()), B, T)


def host_packing(lengths: np.ndarray, T: int) -> Packing:
    """The packing of a right-padded (len(lengths), T) batch from its row lengths, on the host (CPU tensors, what
    the loader's collate attaches to a Batch): the same tensors as `packing(real)`, with no device value read."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B = len(lengths)
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    # token j of the packing, in row b, sits at b*T + (j - cu[b]) of the flattened batch
    index = np.repeat(np.arange(B, dtype=np.int64) * T - cu[:-1], lengths) + np.arange(cu[-1], dtype=np.int64)
    return Packing(torch.from_numpy(index), torch.from_numpy(cu.astype(np.int32)), torch.from_numpy(lengths),
                   int(lengths.max(initial=0)), B, T)


def pack(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """x (B, T, ...) -> (N, ...): the real positions only."""
    return x.flatten(0, 1).index_select(0, p.index)


def unpack(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """x (N, ...) -> (B, T, ...), zeros at the padded positions."""
    out = x.new_zeros(p.B * p.T, *x.shape[1:])
    return out.index_copy(0, p.index, x).view(p.B, p.T, *x.shape[1:])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, is_causal: bool,
                     dropout_p: float, padded_attention) -> torch.Tensor:
    """q (N_q, h, d_k), k and v (N_k, h, d_k) -> (N_q, h, d_k). `padded_attention(q, k, v, mask, is_causal, p)`
    is the padded path's attention on (B, h, T, d_k) tensors, used by the reference."""
    qp, kp = mask
    kernel = varlen_kernel(q, dropout_p)
    if kernel is None:
        return _reference(q, k, v, qp, kp, is_causal, dropout_p, padded_attention)
    if kernel is flash_attn_varlen_func:
        return flash_attn_varlen_func(q, k, v, qp.cu_seqlens, kp.cu_seqlens, qp.max_len, kp.max_len,
                                      dropout_p=dropout_p, causal=is_causal)
    return _torch_varlen(q, k, v, qp, kp, is_causal)


def varlen_kernel(q: torch.Tensor, dropout_p: float):
    """The CUDA varlen kernel for these queries, or None for the reference. Both kernels are flash kernels,
    which take fp16 and bf16 only (torch's refuses float32: "FlashAttention only support fp16 and bf16 data
    type"), so `trainer.precision=fp32` runs the reference."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func
    return torch_varlen_attn if dropout_p == 0 else None


def _torch_varlen(q, k, v, qp: Packing, kp: Packing, is_causal: bool) -> torch.Tensor:
    causal = {"window_size": (-1, 0) if is_causal else (-1, -1)} if WINDOWED else {"is_causal": is_causal}
    return torch_varlen_attn(q, k, v, qp.cu_seqlens, kp.cu_seqlens, qp.max_len, kp.max_len, **causal)


def _reference(q, k, v, qp: Packing, kp: Packing, is_causal: bool, dropout_p: float, padded_attention):
    def padded(x, p):
        return unpack(x, p).transpose(1, 2)  # (B, h, T, d_k)

    key_mask: Optional[torch.Tensor] = None
    if not is_causal:  # causal self-attention: a real query sees only earlier (real) keys
        # An empty sentence (a packed batch's unused slots) keeps its first, zero key: its rows then hold no NaN,
        # whose gradient would be NaN too, and it has no query to read them.
        lengths = kp.lengths.clamp(min=1)
        key_mask = (torch.arange(kp.T, device=k.device)[None, :] < lengths[:, None])[:, None, None, :]
    out = padded_attention(padded(q, qp), padded(k, kp), padded(v, kp), key_mask, is_causal, dropout_p)
    return pack(out.transpose(1, 2), qp)  # (N_q, h, d_k)
