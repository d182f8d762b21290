"""The state of incremental decoding, and how it follows the hypotheses a search keeps."""
from typing import Optional

import torch


class DecoderCache:
    """Per decoder layer: the self-attention keys/values of the positions decoded so far (filled in by
    `MultiHeadAttention` as decoding proceeds) and the cross-attention keys/values of the encoder output
    (computed once per source for all layers by `Transformer.new_cache`), plus the source padding mask."""

    def __init__(self, cross_kv: torch.Tensor, src_mask: torch.Tensor):
        self.self_attn = [{} for _ in range(cross_kv.size(0))]
        self.cross_kv, self.src_mask = cross_kv, src_mask  # (N_dec, 2, B, h, S, d_k), (B, 1, 1, S)

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        return self.self_attn[0]["k"].size(2) if "k" in self.self_attn[0] else 0

    def reorder(self, rows: torch.Tensor, source_rows: Optional[torch.Tensor] = None,
                same_sources: bool = False) -> None:
        """Row i of the batch continues old row `rows[i]`.

        Beam search moves hypotheses between the K rows of one sentence, which hold the same encoder
        keys/values: with `same_sources=True` those stay put, and move only to `source_rows` when finished
        sentences leave the batch (copying them at every step would cost a large share of beam search:
        docs/benchmarks/code-choices.md).
        """
        for layer in self.self_attn:
            for key in list(layer):
                layer[key] = layer[key].index_select(0, rows)
        if same_sources:
            rows = source_rows
        if rows is not None:
            self.cross_kv = self.cross_kv.index_select(2, rows)  # every layer's keys and values in one copy
            self.src_mask = self.src_mask.index_select(0, rows)
