"""The encoder-decoder Transformer (paper Section 3, Figure 1)."""
import math
from dataclasses import asdict, is_dataclass
from typing import List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from transformer.data.batch import PAD
from transformer.layers import DecoderLayer, EncoderLayer

MODEL_KEYS = ("N", "d_model", "d_ff", "h", "dropout", "norm_first", "tie_embeddings", "max_positions")


def sinusoidal_positions(n: int, d_model: int) -> torch.Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # (n, 1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe  # (n, d_model)


class Embedding(nn.Module):
    """Section 3.4: token embeddings scaled by sqrt(d_model), plus sinusoidal positions, then dropout."""

    def __init__(self, vocab_size: int, d_model: int, max_positions: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.scale = math.sqrt(d_model)
        # Not persistent: recomputed, so checkpoints stay small and max_positions can grow after training.
        self.register_buffer("pe", sinusoidal_positions(max_positions, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = ids.size(1)
        if offset + T > self.pe.size(0):
            self.pe = sinusoidal_positions(2 * (offset + T), self.pe.size(1)).to(self.pe.device)
        x = self.tokens(ids) * self.scale  # (B, T, d_model)
        return self.dropout(x + self.pe[offset:offset + T].to(x.dtype))


class DecoderCache:
    """State of incremental decoding: per layer the self-attention keys/values of the positions decoded
    so far, and the cross-attention keys/values of the encoder output (computed once per source)."""

    def __init__(self, self_attn: List[dict], cross_kv: List[tuple], src_mask: torch.Tensor):
        self.self_attn, self.cross_kv, self.src_mask = self_attn, cross_kv, src_mask

    @property
    def length(self) -> int:
        return self.self_attn[0]["k"].size(2) if "k" in self.self_attn[0] else 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keeps rows `index` of the batch (beam search: follow the surviving hypotheses)."""
        for layer in self.self_attn:
            for key in list(layer):
                layer[key] = layer[key].index_select(0, index)
        self.cross_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross_kv]
        self.src_mask = self.src_mask.index_select(0, index)


class Transformer(nn.Module):
    """Encoder-decoder with N layers each side; `encode` and `decode` can be called separately."""

    def __init__(self, cfg, src_vocab_size: int, tgt_vocab_size: int, shared_vocab: bool = False):
        super().__init__()
        self.args = model_args(cfg, src_vocab_size, tgt_vocab_size, shared_vocab)
        a = self.args
        d_model, dropout = a["d_model"], a["dropout"]
        if a["tie_embeddings"] == "all" and not (shared_vocab and src_vocab_size == tgt_vocab_size):
            raise ValueError("model.tie_embeddings=all needs one shared source/target vocabulary "
                             "(use tokenizer=bpe), but this data has separate vocabularies")
        self.src_embed = Embedding(src_vocab_size, d_model, a["max_positions"], dropout)
        self.tgt_embed = Embedding(tgt_vocab_size, d_model, a["max_positions"], dropout)
        layer_args = (d_model, a["d_ff"], a["h"], dropout, a["norm_first"])
        self.encoder = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(a["N"]))
        self.decoder = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(a["N"]))
        # Pre-norm stacks end un-normalised; a final LayerNorm closes each (post-norm already ends in one).
        self.enc_norm = nn.LayerNorm(d_model) if a["norm_first"] else nn.Identity()
        self.dec_norm = nn.LayerNorm(d_model) if a["norm_first"] else nn.Identity()
        self.generator = nn.Linear(d_model, tgt_vocab_size, bias=False)
        self._init_weights()
        # Section 3.4: "we share the same weight matrix between the two embedding layers and the pre-softmax
        # linear transformation". Tied after init so the shared matrix gets one Xavier draw.
        if a["tie_embeddings"] in ("decoder", "all"):
            self.generator.weight = self.tgt_embed.tokens.weight
        if a["tie_embeddings"] == "all":
            self.src_embed.tokens.weight = self.tgt_embed.tokens.weight

    def _init_weights(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for emb in (self.src_embed.tokens, self.tgt_embed.tokens):
            with torch.no_grad():
                emb.weight[PAD].zero_()

    def encode(self, src: torch.Tensor):
        """src (B, S) -> memory (B, S, d_model) and the source padding mask (B, 1, 1, S), True at real tokens."""
        src_mask = (src != PAD)[:, None, None, :]
        x = self.src_embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x), src_mask

    def new_cache(self, memory: torch.Tensor, src_mask: torch.Tensor) -> DecoderCache:
        cross_kv = [layer.cross_attn.project_kv(memory) for layer in self.decoder]
        return DecoderCache([{} for _ in self.decoder], cross_kv, src_mask)

    def decode(self, tgt_in: torch.Tensor, memory: Optional[torch.Tensor] = None,
               src_mask: Optional[torch.Tensor] = None, cache: Optional[DecoderCache] = None) -> torch.Tensor:
        """tgt_in (B, T) -> logits (B, T, V). With `cache`, tgt_in holds only the new positions (usually T=1):
        earlier ones come from the cache, which is extended."""
        if cache is None:
            cross_kv = [layer.cross_attn.project_kv(memory) for layer in self.decoder]
            self_caches = [None] * len(self.decoder)
        else:
            cross_kv, self_caches, src_mask = cache.cross_kv, cache.self_attn, cache.src_mask
        x = self.tgt_embed(tgt_in, offset=cache.length if cache is not None else 0)
        for layer, kv, layer_cache in zip(self.decoder, cross_kv, self_caches):
            x = layer(x, kv, src_mask, cache=layer_cache)
        return self.generator(self.dec_norm(x))  # (B, T, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    def store_attention(self, on: bool = True) -> None:
        """Keep attention weights in each attention module's `last_attention` (for plots)."""
        for m in self.modules():
            if hasattr(m, "store_attention") and not callable(m.store_attention):
                m.store_attention = on


def model_args(cfg, src_vocab_size: int, tgt_vocab_size: int, shared_vocab: bool) -> dict:
    """Everything needed to rebuild the model, as primitives (a checkpoint carries this)."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    elif is_dataclass(cfg):
        cfg = asdict(cfg)
    args = {k: cfg[k] for k in MODEL_KEYS}
    args.update(src_vocab_size=int(src_vocab_size), tgt_vocab_size=int(tgt_vocab_size),
                shared_vocab=bool(shared_vocab))
    return args


def from_args(args: dict) -> Transformer:
    """Rebuilds an (untrained) model from `Transformer.args`, e.g. from a checkpoint's `model_args`."""
    return Transformer({k: args[k] for k in MODEL_KEYS}, args["src_vocab_size"], args["tgt_vocab_size"],
                       args["shared_vocab"])
