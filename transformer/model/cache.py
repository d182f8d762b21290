"""The state of incremental decoding, and how it follows the hypotheses a search keeps."""
from typing import Optional, Tuple

import torch

FIRST_CAPACITY = 32  # target positions the self-attention buffer first holds; it doubles when full


class LayerCache:
    """One decoder layer's view of `DecoderCache.kv`: `MultiHeadAttention` writes the keys/values of the new
    positions into it in place and attends over every position written so far."""

    def __init__(self, cache: "DecoderCache", layer: int):
        self.cache, self.layer = cache, layer

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """k, v (R, h, T, d_k) of the T new positions -> keys and values (R, h, t + T, d_k) of all positions,
        views of the buffer (no copy of the earlier ones)."""
        start, end = self.cache.length, self.cache.length + k.size(2)
        kv = self.cache.kv[:, self.layer]  # (R, 2, h, capacity, d_k)
        kv[:, 0, :, start:end] = k
        kv[:, 1, :, start:end] = v
        return kv[:, 0, :, :end], kv[:, 1, :, :end]


class DecoderCache:
    """Per decoder layer: the self-attention keys/values of the positions decoded so far, in one buffer
    preallocated for all layers and written in place (`LayerCache`), and the cross-attention keys/values of
    the encoder output (computed once per source for all layers by `Transformer.new_cache`), plus the source
    padding mask. Rows come first in both (copying a row is then one block: `index_select` along an inner
    dimension took far longer on a CPU).

    Rows are physical: logical row i (the search's order) lives in buffer row `slots[i]` (None: row i).
    `Transformer.decode` runs the layers in buffer order (`to_slots`, `from_slots`), so that a beam step
    whose hypotheses mostly continue their own parent moves no key/value at all (`reorder`)."""

    def __init__(self, cross_kv: torch.Tensor, src_mask: torch.Tensor):
        # (B, N_dec, 2, h, S, d_k) contiguous, so that rows copy as blocks; (B, 1, 1, S)
        self.memory_kv, self.src_mask = cross_kv.movedim(2, 0).contiguous(), src_mask
        N, _, B, h, _, d_k = cross_kv.shape
        self.kv = cross_kv.new_empty(B, N, 2, h, FIRST_CAPACITY, d_k)  # (R, N_dec, 2, h, capacity, d_k)
        self.length = 0  # target positions decoded so far
        self.slots: Optional[torch.Tensor] = None  # (R,) buffer row of each logical row, None: the identity
        self.order: Optional[torch.Tensor] = None  # (R,) logical row of each buffer row
        self.self_attn = [LayerCache(self, i) for i in range(N)]

    @property
    def cross_kv(self) -> torch.Tensor:
        """(N_dec, 2, B, h, S, d_k), a view: [i, 0] layer i's keys of the encoder output, [i, 1] its values."""
        return self.memory_kv.movedim(0, 2)

    def extend(self, T: int) -> None:
        """Room for T more positions (the buffer doubles, at most log2(length) times in a search)."""
        if self.length + T > self.kv.size(4):
            kv = self.kv.new_empty(*self.kv.shape[:4], max(2 * self.kv.size(4), self.length + T), self.kv.size(5))
            kv[..., :self.length, :] = self.kv[..., :self.length, :]
            self.kv = kv

    def advance(self, T: int) -> None:
        """T positions written by every layer."""
        self.length += T

    def to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, ...) in the search's row order -> in buffer row order."""
        return x if self.slots is None else x.index_select(0, self.order)

    def from_slots(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, ...) in buffer row order -> in the search's row order."""
        return x if self.slots is None else x.index_select(0, self.slots)

    def reorder(self, rows: torch.Tensor, source_rows: Optional[torch.Tensor] = None,
                same_sources: bool = False) -> None:
        """Row i of the batch continues old row `rows[i]`.

        Beam search moves hypotheses between the K rows of one sentence, which hold the same encoder
        keys/values: with `same_sources=True` those stay put, and move only to `source_rows` when finished
        sentences leave the batch (copying them at every step would cost a large share of beam search:
        docs/benchmarks/code-choices.md). Within a sentence the first child of a hypothesis takes over its buffer
        row, and only further children copy the keys/values of their parent, into the row of a hypothesis that has
        none. When rows leave the batch, the buffer is compacted into the search's order.
        """
        if same_sources and source_rows is None and rows.numel() == self._rows():
            self._follow(rows)
            return
        physical = rows if self.slots is None else self.slots.index_select(0, rows)
        kv = self.kv.new_empty(rows.numel(), *self.kv.shape[1:])  # the same capacity
        torch.index_select(self.kv[..., :self.length, :], 0, physical, out=kv[..., :self.length, :])
        self.kv, self.slots = kv, None
        if same_sources:
            rows = source_rows
        if rows is not None:
            # Every layer's keys and values in one copy; indexing copies whole rows, where `index_select` of
            # this 6-dimensional tensor took several times longer on a CPU.
            self.memory_kv = self.memory_kv[rows]
            self.src_mask = self.src_mask.index_select(0, rows)

    def _rows(self) -> int:
        return self.kv.size(0)

    def _follow(self, parent: torch.Tensor) -> None:
        """The rows stay; logical row i continues logical row parent[i] of the same sentence (beam search)."""
        R = parent.numel()
        slots = torch.arange(R, device=parent.device) if self.slots is None else self.slots
        index = torch.arange(R, device=parent.device)
        first = torch.full((R,), R, dtype=torch.long, device=parent.device)
        first.scatter_reduce_(0, parent, index, reduce="amin")  # (R,) each old row's first child, R: none
        is_first = first.index_select(0, parent) == index
        new_slots = slots.index_select(0, parent)
        if not bool(is_first.all()):
            # Both lists ascend, and each sentence has as many extra children as childless hypotheses: the
            # k-th extra child takes the k-th free row, of its own sentence.
            extra, free = (~is_first).nonzero().flatten(), (first == R).nonzero().flatten()
            free_slots = slots.index_select(0, free)
            filled = self.kv[..., :self.length, :]  # (R, N_dec, 2, h, t, d_k), a view
            filled[free_slots] = filled[new_slots.index_select(0, extra)]
            new_slots[extra] = free_slots
        self.slots = new_slots
        self.order = torch.empty_like(new_slots).scatter_(0, new_slots, index)  # buffer row -> logical row
