"""The encoder-decoder Transformer (paper Section 3, Figure 1) and the arguments that rebuild it."""
import math
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from transformer.experimental.varlen import Packing, VarlenMask, load_kernels, pack, packing, unpack
from transformer.model.cache import DecoderCache
from transformer.model.dropout import Dropout, check_rate
from transformer.model.layers import DecoderLayer, EncoderLayer, FeedForward, MultiHeadAttention, padding_bias
from transformer.model.projections import StackedLinear, fuse_projections, replay_linear_init, split_projections
from transformer.model.residual import norm_to, stream_dtype
from transformer.specials import PAD


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to rebuild the model (no defaults here: they live in the config schema,
    `transformer.config.ModelConfig`). A checkpoint stores it as a plain dict (`to_dict`) under "model_args",
    so it loads with `torch.load(weights_only=True)`."""
    N: int  # encoder layers
    N_dec: int  # decoder layers (model.N_dec, or N)
    d_model: int
    d_ff: int
    h: int  # attention heads; d_k = d_v = d_model / h
    dropout: float  # P_drop
    norm_first: bool  # False: post-norm as in the paper; True: pre-norm
    tie_embeddings: str  # none | decoder | all
    max_positions: int
    src_vocab_size: int
    tgt_vocab_size: int
    shared_vocab: bool  # one vocabulary for both sides (needed by tie_embeddings=all)
    # Defaults here only so that code building ModelArgs by hand keeps working: today's behaviour.
    activation: str = "relu"  # feed-forward nonlinearity: relu | swish | gelu
    output_bias: bool = False  # a bias on the generator
    attention_dropout: Optional[float] = None  # on the attention weights; None: dropout
    ffn_dropout: Optional[float] = None  # inside the feed-forward network, after the activation; None: dropout

    @classmethod
    def from_config(cls, model_cfg, src_vocab_size: int, tgt_vocab_size: int, shared_vocab: bool) -> "ModelArgs":
        """From the `model` config section (any object with the ModelConfig attributes) and the data's vocabularies."""
        arch = {f.name: getattr(model_cfg, f.name) for f in fields(cls)
                if f.name not in ("src_vocab_size", "tgt_vocab_size", "shared_vocab")}
        if arch["N_dec"] is None:
            arch["N_dec"] = arch["N"]
        return cls(**arch, src_vocab_size=int(src_vocab_size), tgt_vocab_size=int(tgt_vocab_size),
                   shared_vocab=bool(shared_vocab))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """From a checkpoint's "model_args" (written by any version of this project)."""
        d = cls.upgrade(d)
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError(f"model arguments {sorted(set(d) ^ names)} are unknown or missing")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def upgrade(d: dict) -> dict:
        """A checkpoint's "model_args" as this version writes them (`load_checkpoint` applies it): those written
        before N_dec existed had N layers on both sides."""
        d = {**d, "N_dec": d["N"]} if "N_dec" not in d and "N" in d else d
        # Written before model.activation, model.output_bias, model.attention_dropout and model.ffn_dropout
        # existed: relu, no output bias, the attention weights and the feed-forward network dropped at P_drop.
        old = {"activation": "relu", "output_bias": False, "attention_dropout": None, "ffn_dropout": None}
        return {**old, **d} if "N" in d else d


@dataclass(frozen=True)
class ModelOptions:
    """How this run's model computes, not what it is: given to the constructor from the trainer config
    (`from_trainer`), never stored in a checkpoint, so a model trained with them loads and decodes without."""
    bf16_residual: bool = False  # trainer.bf16_residual: the residual stream in bf16 (transformer/model/residual.py)
    unpadded_attention: bool = False  # trainer.unpadded_attention (transformer/experimental/varlen.py)

    @classmethod
    def from_trainer(cls, tcfg) -> "ModelOptions":
        """From the `trainer` config section."""
        return cls(bf16_residual=bool(tcfg.bf16_residual), unpadded_attention=bool(tcfg.unpadded_attention))


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

    def __init__(self, vocab_size: int, d_model: int, max_positions: int, dropout: float,
                 bf16_residual: bool = False):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.scale = math.sqrt(d_model)
        # Not persistent: recomputed, so checkpoints stay small and max_positions can grow after training.
        self.register_buffer("pe", sinusoidal_positions(max_positions, d_model), persistent=False)
        self.dropout = Dropout(dropout)
        self.bf16_residual = bf16_residual

    def forward(self, ids: torch.Tensor, offset: int = 0, positions: Optional[torch.Tensor] = None,
                longest: int = 0) -> torch.Tensor:
        """ids (B, T) -> (B, T, d_model), positions offset..offset+T-1; or packed ids (N,) at `positions` (N,),
        each < `longest`, -> (N, d_model)."""
        T = ids.size(1) if positions is None else longest
        if offset + T > self.pe.size(0):
            self.pe = sinusoidal_positions(2 * (offset + T), self.pe.size(1)).to(self.pe.device)
        x = self.tokens(ids) * self.scale  # (B, T, d_model) or (N, d_model)
        pe = self.pe[offset:offset + T] if positions is None else self.pe.index_select(0, positions)
        x = self.dropout(x + pe.to(x.dtype))
        dtype = stream_dtype(x) if self.bf16_residual else None
        return x if dtype is None else x.to(dtype)


class Generator(nn.Linear):
    """Section 3.4's pre-softmax linear transformation, to the first `n_out` rows of its matrix: tied to a
    shared embedding, the matrix also holds source-only types that are never output."""

    def __init__(self, d_model: int, rows: int, n_out: int, bias: bool = False):
        super().__init__(d_model, rows, bias=bias)
        self.n_out = n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.n_out == self.weight.size(0) else self.weight[:self.n_out]  # a view, no copy
        b = self.bias if self.bias is None or self.n_out == self.bias.size(0) else self.bias[:self.n_out]
        return F.linear(x, w, b)  # (B, T, n_out)


def _fuse_old_keys(module, state: dict, prefix: str, *args) -> None:
    fuse_projections(state, prefix)


class Transformer(nn.Module):
    """Encoder-decoder with N encoder and N_dec decoder layers (N each side in the paper); `encode` and `decode`
    can be called separately. `options`: how this run computes (ModelOptions; the defaults for decoding)."""

    def __init__(self, args: ModelArgs, options: Optional[ModelOptions] = None):
        super().__init__()
        self.args = a = args
        self.options = o = options or ModelOptions()
        if o.unpadded_attention:
            load_kernels()
        if a.tie_embeddings == "all" and not (a.shared_vocab and a.tgt_vocab_size <= a.src_vocab_size):
            raise ValueError("model.tie_embeddings=all needs one shared source/target vocabulary "
                             "(use tokenizer=bpe), but this data has separate vocabularies")
        # Tied to the source, the target's matrix is the shared one; its first tgt_vocab_size rows are the
        # target's types (tokenizer.tgt_vocab=seen numbers them first), the only ones the generator scores.
        tgt_rows = a.src_vocab_size if a.tie_embeddings == "all" else a.tgt_vocab_size
        with torch.random.fork_rng(devices=[]):  # the constructors' draws are discarded: _init_weights replays them
            self.src_embed = Embedding(a.src_vocab_size, a.d_model, a.max_positions, a.dropout, o.bf16_residual)
            self.tgt_embed = Embedding(tgt_rows, a.d_model, a.max_positions, a.dropout, o.bf16_residual)
            layer_args = (a.d_model, a.d_ff, a.h, a.dropout, a.norm_first, a.activation, o.bf16_residual)
            self.encoder = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(a.N))
            self.decoder = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(a.N_dec))
            # The keys and values of the encoder output for every decoder layer in one product: layer i's
            # keys are rows [2i·d_model, (2i+1)·d_model), its values the next d_model rows (values have a bias).
            self.memory_kv_proj = StackedLinear(a.d_model, a.d_model, biased=(False, True) * a.N_dec)
            # Pre-norm stacks end un-normalised; a final LayerNorm closes each (post-norm already ends in one).
            self.enc_norm = nn.LayerNorm(a.d_model) if a.norm_first else nn.Identity()
            self.dec_norm = nn.LayerNorm(a.d_model) if a.norm_first else nn.Identity()
            self.generator = Generator(a.d_model, tgt_rows, a.tgt_vocab_size, bias=a.output_bias)
        self._init_weights()
        if a.output_bias:
            nn.init.zeros_(self.generator.bias)
        # Section 3.4: "we share the same weight matrix between the two embedding layers and the pre-softmax
        # linear transformation". Tied after init so the shared matrix gets one Xavier draw.
        if a.tie_embeddings in ("decoder", "all"):
            self.generator.weight = self.tgt_embed.tokens.weight
        if a.tie_embeddings == "all":
            self.src_embed.tokens.weight = self.tgt_embed.tokens.weight
        if a.attention_dropout is not None or a.ffn_dropout is not None:  # own rates (layers are built with P_drop)
            self.set_dropout(a.dropout)
        # Checkpoints written with separate q/k/v projections load into the stacked ones.
        if hasattr(self, "register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(_fuse_old_keys)
        else:  # torch < 2.5 has only the private name
            self._register_load_state_dict_pre_hook(_fuse_old_keys, with_module=True)

    @property
    def bf16_residual(self) -> bool:
        """Under bf16 autocast the stream between sublayers (embeddings, every residual add and LayerNorm) is
        stored in bf16, sums and LayerNorm statistics in fp32; no effect without it."""
        return self.options.bf16_residual

    @property
    def unpadded_attention(self) -> bool:
        """`forward` (training and validation loss) runs on the real tokens only, packed, with variable-length
        attention; decoding (`encode`, `decode` with a cache) stays padded."""
        return self.options.unpadded_attention

    @classmethod
    def from_config(cls, model_cfg, src_vocab_size: int, tgt_vocab_size: int,
                    shared_vocab: bool = False, options: Optional[ModelOptions] = None) -> "Transformer":
        """A new model from the `model` config section and the data's vocabularies."""
        return cls(ModelArgs.from_config(model_cfg, src_vocab_size, tgt_vocab_size, shared_vocab), options)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Xavier-uniform matrices, each (d_out, d_in) part of a stacked projection drawn on its own, in the order
        and with the draws of the model with separate projections: the same seed gives the same weights."""
        replay_linear_init(self)
        for p in split_projections(self.state_dict(keep_vars=True), views=True).values():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for emb in (self.src_embed.tokens, self.tgt_embed.tokens):
            with torch.no_grad():
                emb.weight[PAD].zero_()

    def encode(self, src: torch.Tensor):
        """The encoder stack (paper Section 3.1): source embedding and positions (Sections 3.4, 3.5), then N
        layers of self-attention (h heads, Section 3.2.2) and feed-forward (d_ff, Section 3.3).

        Args:
            src: (B, S) source token ids, right-padded with PAD (the source's </s> included).

        Returns:
            memory: (B, S, d_model) the encoder output that every decoder layer attends to.
            src_mask: (B, 1, 1, S) additive (`layers.padding_bias`): 0 at real tokens, -inf at padding, in
                the dtype the attention's queries will have (autocast's, else the weights'); broadcasts over
                heads and query positions.
        """
        device = src.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        src_mask = padding_bias(src != PAD, dtype or self.src_embed.tokens.weight.dtype)
        x = self.src_embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self._final_norm(self.enc_norm, x), src_mask  # (B, S, d_model)

    def project_memory(self, memory: torch.Tensor) -> torch.Tensor:
        """memory (B, S, d_model) -> the cross-attention keys and values of every decoder layer, one product:
        (N_dec, 2, B, h, S, d_k), [i, 0] layer i's keys, [i, 1] its values (the decoding cache's layout)."""
        kv = self._memory_kv(memory).unflatten(-3, (self.args.N_dec, 2))  # (B, S, N_dec, 2, h, d_k)
        return kv.movedim((-4, -3), (0, 1)).transpose(-3, -2)

    def memory_kv_of_layers(self, memory: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """memory (B, S, d_model) -> each decoder layer's (keys, values), each (B, h, S, d_k), from one product;
        packed memory (N_s, d_model) -> (N_s, h, d_k) each. Taken apart along the product's own layout, so
        that autograd assembles their gradients in that layout, as the product's backward reads it: indexing
        a (N_dec, 2, B, h, S, d_k) view instead had the compiled backward zero-fill and write that shape, then
        transpose it in a second pass (docs/benchmarks/switches.md, "Stacked projections")."""
        parts = self._memory_kv(memory).unbind(-3)  # 2·N_dec x (B, S, h, d_k) or (N_s, h, d_k)
        if memory.dim() == 3:
            parts = [p.transpose(1, 2) for p in parts]  # (B, h, S, d_k)
        return list(zip(parts[0::2], parts[1::2], strict=True))

    def _memory_kv(self, memory: torch.Tensor) -> torch.Tensor:
        """The product's output as (B, S, 2·N_dec, h, d_k) (packed: (N_s, 2·N_dec, h, d_k)), a view."""
        h = self.args.h
        return self.memory_kv_proj(memory).view(*memory.shape[:-1], 2 * self.args.N_dec, h, self.args.d_model // h)

    def new_cache(self, memory: torch.Tensor, src_mask: torch.Tensor) -> DecoderCache:
        return DecoderCache(self.project_memory(memory), src_mask)

    def decode(self, tgt_in: torch.Tensor, memory: Optional[torch.Tensor] = None,
               src_mask: Optional[torch.Tensor] = None, cache: Optional[DecoderCache] = None) -> torch.Tensor:
        """The decoder stack (paper Section 3.1) and the pre-softmax projection (Section 3.4): N_dec layers of
        masked self-attention, attention over the encoder output, and feed-forward.

        Args:
            tgt_in: (B, T) target ids starting with <s> (teacher forcing), right-padded with PAD; with
                `cache`, only the new positions (usually T = 1), earlier ones coming from the cache.
            memory: (B, S, d_model) the encoder output (`encode`); unused with `cache`.
            src_mask: (B, 1, 1, S) the source padding mask (`encode`); unused with `cache`.
            cache: a DecoderCache (`new_cache`) of the cross-attention keys/values and earlier self-attention
                keys/values, for incremental decoding; it is extended by T positions.

        Returns:
            (B, T, V) logits over the target vocabulary (V = tgt_vocab_size), unnormalised.
        """
        if cache is None:
            cross_kv = self.memory_kv_of_layers(memory)  # N_dec x ((B, h, S, d_k), (B, h, S, d_k))
            self_caches = [None] * len(self.decoder)
        else:
            cross_kv, self_caches, src_mask = cache.cross_kv, cache.self_attn, cache.src_mask
            cache.extend(tgt_in.size(1))
        x = self.tgt_embed(tgt_in, offset=cache.length if cache is not None else 0)
        if cache is not None:  # the layers run in the cache's row order (DecoderCache.slots)
            x = cache.to_slots(x)
        for layer, kv, layer_cache in zip(self.decoder, cross_kv, self_caches, strict=True):
            x = layer(x, kv, src_mask, cache=layer_cache)
        if cache is not None:
            x = cache.from_slots(x)
            cache.advance(tgt_in.size(1))
        return self.generator(self._final_norm(self.dec_norm, x))  # (B, T, V)

    def _final_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        dtype = stream_dtype(x) if self.bf16_residual else None
        return norm(x) if dtype is None else norm_to(norm, x, dtype)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor,
                packings: Optional[Tuple[Packing, Packing]] = None) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). `packings`: the (source, target) packings of the
        real tokens (`Batch.packings`, made by the loader), used with unpadded attention; without them it
        packs here, reading two device values (a host sync each)."""
        if self.unpadded_attention:
            if src.dim() == 1:  # a packed batch (transformer/experimental/packed.py): logits of its target tokens only
                return self._forward_tokens(src, tgt_in, packings)
            return self._forward_packed(src, tgt_in, packings)
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    def _forward_packed(self, src: torch.Tensor, tgt_in: torch.Tensor,
                        packings: Optional[Tuple[Packing, Packing]]) -> torch.Tensor:
        """`forward` on the real tokens only (transformer/experimental/varlen.py): every layer runs on packed rows;
        the logits of padded target positions are those of a zero decoder output (the loss ignores them)."""
        if packings is None:
            sp, tp = packing(src != PAD), packing(tgt_in != PAD)
        else:  # the batch may have been padded further since it was collated (trainer.pad_to_multiple)
            sp, tp = packings[0].fit(*src.shape), packings[1].fit(*tgt_in.shape)
        x = pack(self.src_embed(src), sp)  # (N_s, d_model)
        for layer in self.encoder:
            x = layer(x, VarlenMask(sp, sp))
        memory_kv = self.memory_kv_of_layers(self._final_norm(self.enc_norm, x))  # N_dec x 2 x (N_s, h, d_k)
        y = pack(self.tgt_embed(tgt_in), tp)  # (N_t, d_model)
        for layer, kv in zip(self.decoder, memory_kv, strict=True):
            y = layer(y, kv, VarlenMask(tp, sp), tgt_mask=VarlenMask(tp, tp))
        return self.generator(unpack(self._final_norm(self.dec_norm, y), tp))  # (B, T, V)

    def _forward_tokens(self, src: torch.Tensor, tgt_in: torch.Tensor, packings: Tuple[Packing, Packing]):
        """`forward` on a packed batch: src (N_s,), tgt_in (N_t,), the sentences end to end as `packings` say
        (their width T sets each token's position, index % T) -> logits (N_t, V)."""
        sp, tp = packings
        x = self.src_embed(src, positions=sp.index % sp.T, longest=sp.T)  # (N_s, d_model)
        for layer in self.encoder:
            x = layer(x, VarlenMask(sp, sp))
        memory_kv = self.memory_kv_of_layers(self._final_norm(self.enc_norm, x))  # N_dec x 2 x (N_s, h, d_k)
        y = self.tgt_embed(tgt_in, positions=tp.index % tp.T, longest=tp.T)  # (N_t, d_model)
        for layer, kv in zip(self.decoder, memory_kv, strict=True):
            y = layer(y, kv, VarlenMask(tp, sp), tgt_mask=VarlenMask(tp, tp))
        return self.generator(self._final_norm(self.dec_norm, y))  # (N_t, V)

    def set_dropout(self, p: float) -> None:
        """P_drop of every dropout in the model (embeddings, sublayers, and the attention weights and the
        feed-forward network's inner dropout unless model.attention_dropout and model.ffn_dropout set theirs), for
        a schedule over training (trainer.dropout_by_epoch); the weights and model args are untouched."""
        check_rate(p)
        attention = p if self.args.attention_dropout is None else check_rate(self.args.attention_dropout)
        ffn = p if self.args.ffn_dropout is None else check_rate(self.args.ffn_dropout)
        for m in self.modules():
            if isinstance(m, Dropout):
                m.p = p
            elif isinstance(m, MultiHeadAttention):
                m.dropout = attention
        for m in self.modules():  # after the loop above, which visits a FeedForward before its Dropout
            if isinstance(m, FeedForward):
                m.dropout.p = ffn

    def record_attention(self, on: bool = True) -> None:
        """Keep the attention weights of every attention module in its `last_attention` (for plots)."""
        for m in self.modules():
            if hasattr(m, "keep_attention"):
                m.keep_attention = on
