"""Packed token budgets (trainer.static_shapes, or trainer.cuda_graphs, with trainer.unpadded_attention): a
training micro-batch is its real tokens end to end, filled up to one of a few fixed token counts, so CUDA graphs
and torch.compile see a handful of shapes and no position is spent on padding.

The sampler cuts the length-sorted examples where either side's real tokens would pass data.max_tokens less a
small reserve (`reserve`), so batches fill their budget instead of rows x longest length. `collate` then lays the
batch out flat: source (N_s,), target input and output (N_t,), each side's token count rounded up a ladder of
`steps` values an octave (`budget`, never above data.max_tokens), the gap filled with filler sentence pairs of at
most FILLER tokens a side (source `</s>`, target input <pad>, target output <pad>: no loss, no gradient, and every
filler sentence has a token on each side, so no attention row is empty).

The sentence count (real and filler) is rounded up to a power of two with empty sentences (length 0), so
`cu_seqlens` has a few sizes too: an empty sentence has no query to compute (what its idle thread blocks cost a
GPU is not measured yet). The packings' width T, the longest sentence a side may hold (the training split's
longest, on the ladder: the same for every batch), fixes the flat positions (`index = sentence * T + position`),
and `index % T` gives each token its position for the embeddings. A static shape is then
(sentences, N_s, N_t, T_s, T_t) (`Layout.shape`, `shape_of`): what a CUDA graph is captured for.
"""
from typing import List, NamedTuple, Tuple

import numpy as np
import torch

from transformer.data.shapes import STEPS, shape_length
from transformer.experimental.varlen import Packing, host_packing
from transformer.specials import EOS, PAD

FILLER = 64  # longest filler sentence, a side (longer only when few filler tokens must cover many on the other side)


def reserve(cap: int) -> int:
    """Tokens a side the sampler leaves free under the cap `cap` (data.max_tokens): room for the filler pairs that
    round the batch up to its budget, each needing a token on both sides."""
    return cap // 256 + 1


def budget(n: int, cap: int, steps: int = STEPS) -> int:
    """The token count a side of `n` real tokens is filled up to: the ladder value >= n + reserve(cap), at most
    `cap`. The sampler keeps n + reserve(cap) <= cap, so there is always room for at least one filler token."""
    return min(shape_length(n + reserve(cap), steps), cap)


def filler_lengths(f_src: int, f_tgt: int) -> Tuple[np.ndarray, np.ndarray]:
    """(source, target) lengths of the filler pairs covering f_src and f_tgt tokens (both >= 1): as few pairs of at
    most FILLER tokens as cover the larger side, fewer if the smaller side has not a token for each."""
    k = max(1, min(f_src, f_tgt, max(-(-f_src // FILLER), -(-f_tgt // FILLER))))

    def split(f: int) -> np.ndarray:
        sizes = np.full(k, f // k, dtype=np.int64)
        sizes[:f % k] += 1
        return sizes
    return split(f_src), split(f_tgt)


class Layout(NamedTuple):
    """Where a packed batch's sentences go: every sentence's (source, target) lengths, filler pairs included,
    the sentence slots (empty ones after them), the widths and the token budgets."""
    src_lengths: np.ndarray
    tgt_lengths: np.ndarray
    slots: int
    T_s: int
    T_t: int
    N_s: int
    N_t: int

    @property
    def shape(self) -> tuple:
        """The static shape: (sentence slots, N_s, N_t, T_s, T_t)."""
        return self.slots, self.N_s, self.N_t, self.T_s, self.T_t


def layout(src_lens: np.ndarray, tgt_lens: np.ndarray, cap: int, steps: int = STEPS,
           widths: Tuple[int, int] = (0, 0)) -> Layout:
    """The layout of sentences of `src_lens` and `tgt_lens` tokens (specials included) under the cap `cap`.
    `widths`: the smallest (T_s, T_t) to use (the split's longest sentences: then every batch has the same)."""
    n_src, n_tgt = int(src_lens.sum()), int(tgt_lens.sum())
    if max(n_src, n_tgt) + reserve(cap) > cap:
        raise ValueError(f"a packed batch of {n_src} source and {n_tgt} target tokens does not fit "
                         f"data.max_tokens={cap} with its reserve of {reserve(cap)}")
    N_s, N_t = budget(n_src, cap, steps), budget(n_tgt, cap, steps)
    fill_src, fill_tgt = filler_lengths(N_s - n_src, N_t - n_tgt)
    all_src, all_tgt = np.concatenate([src_lens, fill_src]), np.concatenate([tgt_lens, fill_tgt])
    slots = 1 << (len(all_src) - 1).bit_length()  # a power of two: few sizes of cu_seqlens
    T_s, T_t = (shape_length(max(w, int(n.max())), steps) for w, n in zip(widths, (all_src, all_tgt), strict=True))
    return Layout(all_src, all_tgt, slots, T_s, T_t, N_s, N_t)


def _packing(lengths: np.ndarray, slots: int, T: int) -> Packing:
    """The packing of sentences of `lengths` laid end to end, then empty sentences up to `slots`, at width T; its
    longest is T, fixed for every batch of the shape (the attention kernels' bound)."""
    return host_packing(np.concatenate([lengths, np.zeros(slots - len(lengths), dtype=np.int64)]), T)._replace(
        max_len=T)


def collate(items: List[Tuple[int, np.ndarray, np.ndarray]], cap: int, steps: int = STEPS,
            widths: Tuple[int, int] = (0, 0)):
    """The sampler's examples as one packed, budget-sized Batch: src (N_s,), tgt_in and tgt_out (N_t,), and the
    packings of both sides (filler and empty sentences included). CPU tensors, one buffer (see batch.collate).
    `widths`: see `layout`."""
    from transformer.data.batch import Batch, pair_lengths, write_pair

    src_lens, tgt_lens = pair_lengths(items)
    lay = layout(src_lens, tgt_lens, cap, steps, widths)
    N_s, N_t = lay.N_s, lay.N_t
    B = len(items)
    flat = torch.full((N_s + 2 * N_t + B,), PAD, dtype=torch.long)
    src, tgt_in, tgt_out, ids = flat.split([N_s, N_t, N_t, B])
    s = t = 0
    for _, x, y in items:
        write_pair(src[s:], tgt_in[t:], tgt_out[t:], x, y)
        s, t = s + len(x) + 1, t + len(y) + 1
    src[s:] = EOS  # filler sources: a real key for every filler target to attend to
    ids.copy_(torch.tensor([i for i, _, _ in items], dtype=torch.long))
    packings = (_packing(lay.src_lengths, lay.slots, lay.T_s), _packing(lay.tgt_lengths, lay.slots, lay.T_t))
    return Batch(src, tgt_in, tgt_out, ids, int(tgt_lens.sum()), packings)


def shape_of(batch) -> tuple:
    """The static shape of a packed Batch: (sentence slots, N_s, N_t, T_s, T_t)."""
    sp, tp = batch.packings
    return sp.B, batch.src.size(0), batch.tgt_in.size(0), sp.T, tp.T


def real_lengths(batch) -> Tuple[np.ndarray, np.ndarray]:
    """The real sentences' (source, target) lengths of a packed Batch (its first len(ids) sentences)."""
    B = batch.ids.size(0)
    return batch.packings[0].lengths[:B].numpy(), batch.packings[1].lengths[:B].numpy()


class Collate:
    """`collate` with its cap and ladder, picklable for DataLoader workers started by spawn."""

    def __init__(self, cap: int, steps: int = STEPS, widths: Tuple[int, int] = (0, 0)):
        self.cap, self.steps, self.widths = cap, steps, widths

    def __call__(self, items):
        return collate(items, self.cap, self.steps, self.widths)
