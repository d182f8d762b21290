"""Model FLOPs of the encoder-decoder (paper Section 3) from a batch's real padded shapes.

Counted: the matrix products, 2 FLOPs per multiply-add, for a batch of B sentences padded to S source
and T target positions (d = d_model, f = d_ff, V = target vocabulary, N encoder and N_dec decoder layers):

    encoder layer   8·B·S·d²  (Q, K, V, output projections)  + 4·B·S²·d (Q·Kᵀ and weights·V) + 4·B·S·d·f (FFN)
    decoder layer   8·B·T·d² + 4·B·T²·d   (masked self-attention, counted as full: causal kernels may skip
                                          half of the score matrix, FlopCounterMode and MFU conventions do not)
                  + 4·B·T·d² + 4·B·S·d² + 4·B·T·S·d   (cross-attention: Q and output on T, K and V on S)
                  + 4·B·T·d·f
    generator       2·B·T·d·V

forward = N·encoder layer + N_dec·decoder layer + generator; a training step costs 3 × forward (the backward
pass computes the gradients of both operands of every product: twice the forward). Embedding lookups,
softmax, layer norms and the loss are not matrix products and are left out, as in MFU reports
(PaLM, Appendix B). `step_flops` counts the shapes the model runs on, padded positions included: computed, not useful.
`real_flops` counts only what each sentence needs, every sentence at its own (source, target) length, as
an unpadded (packed) run would compute it: `transformer-bench` reports MFU on that and the difference
(padding to the batch's longest sentence, and to `trainer.pad_to_multiple`) as waste.
"""
from typing import Iterable, Sequence, Tuple

import numpy as np

from transformer.model.transformer import ModelArgs


def forward_flops(args: ModelArgs, B: int, S: int, T: int) -> int:
    """FLOPs of one forward pass of `Transformer` with `args` (its `model.args`) on a (B, S) x (B, T) batch."""
    d, f, V = args.d_model, args.d_ff, args.tgt_vocab_size
    encoder = 8 * B * S * d * d + 4 * B * S * S * d + 4 * B * S * d * f
    decoder = (8 * B * T * d * d + 4 * B * T * T * d
               + 4 * B * T * d * d + 4 * B * S * d * d + 4 * B * T * S * d
               + 4 * B * T * d * f)
    return args.N * encoder + args.N_dec * decoder + 2 * B * T * d * V


def training_flops(args: ModelArgs, B: int, S: int, T: int) -> int:
    """Forward + backward of one micro-batch: 3 x forward."""
    return 3 * forward_flops(args, B, S, T)


def step_flops(args: ModelArgs, shapes: Iterable[Tuple[int, int, int]]) -> int:
    """One optimiser step of this worker: the sum over its micro-batches' (B, S, T)."""
    return sum(training_flops(args, B, S, T) for B, S, T in shapes)


def real_flops(args: ModelArgs, src_lens: Sequence[int], tgt_lens: Sequence[int]) -> int:
    """Training FLOPs of sentences at their own lengths (non-pad source and target tokens of each), no padding:
    the sum over sentences of a (1, s, t) batch's (one vectorised evaluation of the formula)."""
    s, t = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
    if s.shape != t.shape:
        raise ValueError(f"{s.shape[0]} source lengths but {t.shape[0]} target lengths")
    return int(training_flops(args, 1, s, t).sum())
