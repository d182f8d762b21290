"""The model of the paper: `ModelArgs` (what a checkpoint stores to rebuild it), `ModelOptions` (how a run
computes with it), `Transformer`, its layers, the key/value cache of incremental decoding, and the key maps
between stacked and separate q/k/v projections (`split_projections` for exporters, `fuse_projections` for older
state dicts)."""
from transformer.model.cache import DecoderCache
from transformer.model.projections import fuse_projections, split_projections
from transformer.model.transformer import ModelArgs, ModelOptions, Transformer

__all__ = ["DecoderCache", "ModelArgs", "ModelOptions", "Transformer", "fuse_projections", "split_projections"]
