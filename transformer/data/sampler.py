"""Token-bucketed batches sharded across ranks (fairseq's `max_tokens`).

The batch list of an epoch depends only on (seed, epoch, world size), never on the rank, so every
rank can compute it alone. Rank r takes batches r, r+W, r+2W, ...: with W workers one optimiser
step sees the same micro-batches as one worker with `trainer.accumulate=W`. The count is made a
multiple of W by splitting the largest batches, so every example is seen exactly once per epoch
and every rank has the same number of batches (no rank waits forever at the epoch end).
"""
from typing import List, Optional, Sequence

import numpy as np

from transformer.data.shapes import STEPS, shape_length
from transformer.experimental.packed import reserve


class TokenBatchSampler:
    def __init__(self, src_sizes: np.ndarray, tgt_sizes: np.ndarray, max_tokens: int,
                 max_sentences: Optional[int] = None, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, max_tokens_by_epoch: Sequence[int] = (), static_shapes: bool = False,
                 shape_steps: int = STEPS, packed: bool = False):
        """`*_sizes` are padded lengths (special tokens included). A batch of n pairs costs
        n * max(longest source, longest target) tokens, which must stay <= max_tokens, or, in the first
        len(max_tokens_by_epoch) epochs, <= the epoch's entry there (a ramp of batch sizes). With
        `static_shapes` a length costs its ladder length (transformer/data/shapes.py, `shape_steps` lengths an
        octave), so the batch padded to its static shape still fits the budget. With `packed` (packed token
        budgets, transformer/experimental/packed.py) a batch costs its real tokens instead: each side's sum stays within
        the budget less the filler reserve."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.src_sizes = np.asarray(src_sizes, dtype=np.int64)
        self.tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64)
        self.max_tokens, self.max_sentences = max_tokens, max_sentences or len(self.src_sizes)
        self.max_tokens_by_epoch = list(max_tokens_by_epoch)
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.static_shapes, self.shape_steps, self.packed = static_shapes, shape_steps, packed
        self._cache: tuple = (None, None)
        longest = int(np.maximum(self.src_sizes, self.tgt_sizes).max(initial=0))
        by_epoch = self.max_tokens_by_epoch
        key, what = (("data.max_tokens_by_epoch", f" entry {min(by_epoch)}") if min(by_epoch, default=max_tokens)
                     < max_tokens else ("data.max_tokens", f"={max_tokens}"))
        if longest > min(by_epoch + [max_tokens]):
            raise ValueError(f"{key}{what} is smaller than the longest example ({longest} tokens): "
                             f"raise {key} or lower data.max_len")
        if len(self.src_sizes) < world_size:
            raise ValueError(f"{len(self.src_sizes)} examples cannot be shared by {world_size} workers")

    def epoch_batches(self, epoch: int) -> List[np.ndarray]:
        """All ranks' batches of `epoch`, in the order they are consumed. Vectorised: planning an epoch
        of 4.5M pairs costs a sort and one `searchsorted` per batch (benchmarks/bench_scale.py)."""
        if self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        n = len(self.src_sizes)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        # Sort by the batch cost's own length, max(source, target), then target, then source, so a batch
        # holds similar lengths on both sides; the permutation breaks the remaining ties at random. It pads
        # fewer tokens than a (target, source) sort (benchmarks/bench_data.py; docs/benchmarks/code-choices.md).
        # One stable sort of a combined key is the lexsort of the three keys.
        size = np.maximum(self.src_sizes, self.tgt_sizes)
        bits = max(int(size.max(initial=0)).bit_length(), 1)
        key = (size << (2 * bits)) | (self.tgt_sizes << bits) | self.src_sizes
        order = order[np.argsort(key[order], kind="stable")]
        cost = size[order]
        if self.static_shapes:  # the ladder is non-decreasing in the size: the sorted order stays sorted
            ladder = [shape_length(n, self.shape_steps) for n in range(int(size.max(initial=0)) + 1)]
            cost = np.array(ladder, dtype=np.int64)[cost]
        bounds = (self._packed_bounds(order, self.tokens_of(epoch) - reserve(self.cap)) if self.packed
                  else self._bounds(cost, self.tokens_of(epoch)))
        batches = [order[a:b] for a, b in bounds]
        batches = self._split_to_multiple(batches)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        self._cache = (epoch, batches)
        return batches

    def tokens_of(self, epoch: int) -> int:
        """The batch size in tokens of `epoch`: its entry of max_tokens_by_epoch, max_tokens after the list.
        A function of the epoch alone, so a resumed run plans the batches its first run would have."""
        by_epoch = self.max_tokens_by_epoch
        return by_epoch[epoch] if epoch < len(by_epoch) else self.max_tokens

    def _bounds(self, size: np.ndarray, max_tokens: int):
        """Greedy packing of `size` (non-decreasing, so a batch's last example is its longest): a batch from
        `start` ends before the first i with (i - start + 1) * size[i] > max_tokens or more than
        max_sentences examples. With cap[i] = min(max_tokens // size[i], max_sentences), that first i is the
        first with i + 1 - cap[i] > start, and i + 1 - cap[i] is strictly increasing: a binary search."""
        cap = np.minimum(max_tokens // np.maximum(size, 1), self.max_sentences)
        reach = np.arange(1, len(size) + 1) - cap
        start = 0
        while start < len(size):
            end = max(int(np.searchsorted(reach, start, side="right")), start + 1)
            yield start, end
            start = end

    @property
    def cap(self) -> int:
        """The largest token budget of any epoch: what packed batches are filled up to at most."""
        return max([self.max_tokens, *self.max_tokens_by_epoch])

    def check_packed(self) -> None:
        """Packed budgets: the longest example and the filler reserve must fit the smallest budget."""
        longest = int(max(self.src_sizes.max(initial=0), self.tgt_sizes.max(initial=0)))
        smallest = min([self.max_tokens, *self.max_tokens_by_epoch])
        if longest + reserve(self.cap) > smallest:
            raise ValueError(f"data.max_tokens={smallest} cannot hold the longest example ({longest} tokens) and "
                             f"the packed batches' filler reserve ({reserve(self.cap)}): raise data.max_tokens")

    def _packed_bounds(self, order: np.ndarray, limit: int):
        """Greedy packing by real tokens: a batch from `start` ends before the first example that would take the
        source's or the target's sum past `limit`, or past max_sentences examples (cumulative sums and a binary
        search a batch)."""
        sums = [np.concatenate([[0], np.cumsum(sizes[order])]) for sizes in (self.src_sizes, self.tgt_sizes)]
        n, start = len(order), 0
        while start < n:
            end = min([int(np.searchsorted(c, c[start] + limit, side="right")) - 1 for c in sums]
                      + [start + self.max_sentences, n])
            end = max(end, start + 1)
            yield start, end
            start = end

    def _split_to_multiple(self, batches: List[np.ndarray]) -> List[np.ndarray]:
        while len(batches) % self.world_size:
            j = max(range(len(batches)), key=lambda k: len(batches[k]))
            b = batches[j]
            if len(b) < 2:
                raise ValueError(f"cannot split {len(batches)} batches evenly across {self.world_size} workers")
            batches[j:j + 1] = [b[:len(b) // 2], b[len(b) // 2:]]
        return batches

    def rank_batches(self, epoch: int, start: int = 0) -> List[np.ndarray]:
        """This rank's batches of `epoch`, skipping the first `start` (resume mid-epoch)."""
        return self.epoch_batches(epoch)[self.rank::self.world_size][start:]

    def num_batches(self, epoch: int) -> int:
        """Batches per rank in `epoch` (the same on every rank)."""
        return len(self.epoch_batches(epoch)) // self.world_size
