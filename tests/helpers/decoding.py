"""Reference decoding for tests and benchmarks: the uncached decoder (the whole prefix re-run at every
step, as the Annotated Transformer does), and the searches with EvalConfig's default settings."""
from typing import Optional

import torch

from transformer.config import EvalConfig
from transformer.decoding import beam_search, greedy_search


class PrefixCache:
    """Stands in for `DecoderCache`: keeps the tokens decoded so far and the encoder output instead of
    keys/values, so every step re-runs the decoder over the whole prefix."""

    def __init__(self, memory: torch.Tensor, src_mask: torch.Tensor):
        self.memory, self.src_mask = memory, src_mask
        self.tokens: Optional[torch.Tensor] = None  # (R, t)

    def reorder(self, rows, source_rows=None, same_sources: bool = False) -> None:
        if self.tokens is not None:  # None: beam search spreading each sentence over its K rows before step 0
            self.tokens = self.tokens.index_select(0, rows)
        if same_sources:  # the K rows of a sentence share its encoder output: it moves with the sentences
            rows = source_rows
        if rows is not None:
            self.memory, self.src_mask = self.memory.index_select(0, rows), self.src_mask.index_select(0, rows)


class Uncached(torch.nn.Module):
    """`model` decoded without a key/value cache: same searches, same hypotheses, quadratic cost."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self, memory, src_mask) -> PrefixCache:
        return PrefixCache(memory, src_mask)

    def decode(self, tgt_in, cache: PrefixCache):
        cache.tokens = tgt_in if cache.tokens is None else torch.cat([cache.tokens, tgt_in], dim=1)
        return self.model.decode(cache.tokens, cache.memory, cache.src_mask)[:, -1:]  # (R, 1, V)


def decode_last(model, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
    """Uncached step: the decoder over the whole prefix `tokens` (R, T), the output projection applied to
    the last position only -> logits (R, V)."""
    x = model.tgt_embed(tokens)  # (R, T, D)
    for layer, kv in zip(model.decoder, model.project_memory(memory), strict=True):
        x = layer(x, kv, src_mask)
    return model.generator(model.dec_norm(x[:, -1]))  # (R, V)


def greedy(model, src, stop_at_eos: bool = True, **settings):
    """Token lists of greedy search with EvalConfig's default settings (`settings` on top)."""
    ev = EvalConfig(**settings)
    return [h.tokens for h in greedy_search(model, src, ev.lenpen, ev.max_len_a, ev.max_len_b, stop_at_eos)]


def beam(model, src, beam: int, nbest: int = 1, stop_at_eos: bool = True, **settings):
    """beam_search with EvalConfig's default settings (`settings` on top)."""
    ev = EvalConfig(**settings)
    return beam_search(model, src, beam, ev.lenpen, ev.max_len_a, ev.max_len_b, nbest, stop_at_eos)
