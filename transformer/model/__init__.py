"""The model of the paper: `ModelArgs` (what a checkpoint stores to rebuild it), `Transformer`, its layers,
and the key/value cache of incremental decoding."""
from transformer.model.cache import DecoderCache
from transformer.model.transformer import ModelArgs, Transformer

__all__ = ["DecoderCache", "ModelArgs", "Transformer"]
