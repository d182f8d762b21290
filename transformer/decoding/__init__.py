"""Decoding (paper Section 6.1: beam search with a length penalty): the searches over the cached decoder
(`search`), and whole sentences in and out (`translate`)."""
from transformer.decoding.search import Hypothesis, beam_search, greedy_decode, greedy_search, search
from transformer.decoding.translate import encode_batch, length_batches, translate_ids, translate_sentences

__all__ = ["Hypothesis", "beam_search", "encode_batch", "greedy_decode", "greedy_search", "length_batches", "search",
           "translate_ids", "translate_sentences"]
