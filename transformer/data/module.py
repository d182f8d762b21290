"""What the trainer sees of a dataset: loaders of padded batches for this rank, and the tokenizer."""
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from transformer.data.batch import Batch, PairDataset, collate, packed_collate
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shapes import STEPS
from transformer.experimental import packed


def loader_workers(num_workers: Optional[int], device: torch.device) -> int:
    """data.num_workers, or its default: 2 on a GPU (batches are collated while the GPU computes), 0 on a CPU
    (where collation would take cores from the step)."""
    if num_workers is not None:
        return num_workers
    return 2 if device.type == "cuda" else 0


class EpochPlan:
    """A batch sampler whose batches are set before each pass: one DataLoader, and with it its worker processes,
    serves every epoch. The DataLoader iterates its batch sampler in the main process at each `iter()`, so the
    batches (the sampler's plan of the epoch from `start`) are exactly those a fresh loader would take."""

    def __init__(self):
        self.batches: List[np.ndarray] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class DataModule:
    """Train/valid splits as `PairDataset`s plus the tokenizer that made them, batched by tokens as the paper
    batches (Section 5.1: sentence pairs of similar length, a budget of source and target tokens per batch).

    Its loaders yield `Batch`es of this rank's share: src (B, S), tgt_in and tgt_out (B, T), right-padded
    with PAD, B varying with the sentence lengths under the token budget.

    Args:
        train, valid: the splits, token ids per sentence pair.
        tokenizer: has `encode_src(str) -> list[int]`, `decode_tgt(list[int]) -> str`, `src_vocab_size`,
            `tgt_vocab_size`, `shared_vocab` and `state_dict()` (primitives only, stored in checkpoints).
        max_tokens: the token budget of one batch (data.max_tokens): n pairs cost n * max(longest source,
            longest target) tokens, padding included.
        max_sentences: a cap on sentences per batch (None: none).
        seed: the shuffle seed; with the epoch it fixes every epoch's batches.
        rank, world_size: this worker's share of each epoch's batches.
        num_workers, pin_memory: DataLoader settings (pinned host memory for GPU copies).
        valid_refs, valid_srcs: the validation split's raw text, for BLEU.
        max_tokens_by_epoch: per-epoch token budgets (data.max_tokens_by_epoch), then max_tokens.
        train_of_epoch: epoch -> that epoch's training split (BPE-dropout, transformer/data/bpe_dropout.py);
            its batches are planned from its own lengths. None: `train` every epoch.
    """

    task = "translation"  # "copy" for the synthetic task: validated by exact-match accuracy, not BLEU
    # Batches carry their packings, made on the host (trainer.unpadded_attention: the Trainer sets it)
    packings = False

    def __init__(self, train: PairDataset, valid: PairDataset, tokenizer, *, max_tokens: int,
                 max_sentences: Optional[int], seed: int, rank: int, world_size: int, num_workers: int = 0,
                 pin_memory: bool = False, valid_refs: Optional[Sequence[str]] = None,
                 valid_srcs: Optional[Sequence[str]] = None, max_tokens_by_epoch: Sequence[int] = (),
                 train_of_epoch: Optional[Callable[[int], PairDataset]] = None):
        self.train, self.valid, self.tokenizer = train, valid, tokenizer
        self.train_of_epoch = train_of_epoch
        self._epochs: Dict[int, Tuple[PairDataset, TokenBatchSampler]] = {}  # the last two epochs asked for
        self.rank, self.world_size = rank, world_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.valid_srcs, self.valid_refs = valid_srcs, valid_refs  # raw text of the valid split, for BLEU
        self._plan = EpochPlan()
        self._persistent: Optional[torch.utils.data.DataLoader] = None  # the training loader with persistent workers
        self._sampler_args = dict(max_tokens=max_tokens, max_sentences=max_sentences, seed=seed, rank=rank,
                                  world_size=world_size, shuffle=True, max_tokens_by_epoch=max_tokens_by_epoch)
        self.train_sampler = TokenBatchSampler(train.src_sizes, train.tgt_sizes, **self._sampler_args)
        self.valid_sampler = TokenBatchSampler(valid.src_sizes, valid.tgt_sizes, max_tokens, max_sentences,
                                               seed=seed, rank=rank, world_size=world_size, shuffle=False)

    def use_static_shapes(self, steps: int = STEPS) -> None:
        """trainer.static_shapes: training batches packed by ladder lengths of `steps` lengths an octave
        (trainer.shape_steps; transformer/data/shapes.py), so each padded to its static shape fits
        data.max_tokens. Before the first epoch is planned, or it is planned again."""
        self._sampler_args.update(static_shapes=True, shape_steps=steps)
        sampler = self.train_sampler
        sampler.static_shapes, sampler.shape_steps, sampler._cache = True, steps, (None, None)
        self._epochs.clear()

    def use_packed_budgets(self, steps: int = STEPS) -> None:
        """trainer.static_shapes (or cuda_graphs) with trainer.unpadded_attention: training batches cut by their
        real tokens and collated flat, filled up to a few token budgets (transformer/experimental/packed.py).
        Validation batches stay padded, with their packings. Before the first epoch is planned."""
        self._sampler_args.update(packed=True, shape_steps=steps)
        self.train_sampler = TokenBatchSampler(self.train.src_sizes, self.train.tgt_sizes, **self._sampler_args)
        self.train_sampler.check_packed()
        self._epochs.clear()

    @property
    def src_vocab_size(self) -> int:
        return self.tokenizer.src_vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.tokenizer.tgt_vocab_size

    @property
    def shared_vocab(self) -> bool:
        return self.tokenizer.shared_vocab

    def _train(self, epoch: int) -> Tuple[PairDataset, TokenBatchSampler]:
        if self.train_of_epoch is None:
            return self.train, self.train_sampler
        if epoch not in self._epochs:
            data = self.train_of_epoch(epoch)
            if len(self._epochs) == 2:
                del self._epochs[next(iter(self._epochs))]  # the oldest
            # An epoch before data.bpe_dropout_from_epoch is the stored split, whose batches are planned already.
            sampler = self.train_sampler if data is self.train else TokenBatchSampler(
                data.src_sizes, data.tgt_sizes, **self._sampler_args)
            self._epochs[epoch] = data, sampler
        return self._epochs[epoch]

    def set_budgets(self, max_tokens: int, max_tokens_by_epoch: Sequence[int] = ()) -> None:
        """New token budgets for the training batches (trainer.micro_batch=fit), before the first epoch is
        planned; validation keeps data.max_tokens."""
        self._sampler_args.update(max_tokens=max_tokens, max_tokens_by_epoch=list(max_tokens_by_epoch))
        train = self.train
        self.train_sampler = TokenBatchSampler(train.src_sizes, train.tgt_sizes, **self._sampler_args)
        self._epochs = {}

    def num_train_batches(self, epoch: int) -> int:
        return self._train(epoch)[1].num_batches(epoch)

    def train_loader(self, epoch: int, start: int = 0) -> Iterable[Batch]:
        """This rank's batches of `epoch` from index `start` on (the sampler state the trainer saves). With
        loader workers, they persist from epoch to epoch (one DataLoader over an `EpochPlan`): iterate one
        epoch's loader at a time, as the trainer does. A split rebuilt each epoch (BPE-dropout) gets a
        loader, and workers, of its own."""
        data, sampler = self._train(epoch)
        batches = sampler.rank_batches(epoch, start)
        if not self.num_workers or data is not self.train:
            return self._loader(data, batches, self._train_collate)
        if self._persistent is None:
            self._persistent = torch.utils.data.DataLoader(
                self.train, batch_sampler=self._plan, collate_fn=self._train_collate, num_workers=self.num_workers,
                pin_memory=self.pin_memory, persistent_workers=True, prefetch_factor=4)
        self._plan.batches = batches  # read by the next iter(): the workers' queues are refilled from it
        return self._persistent

    def valid_loader(self) -> Iterable[Batch]:
        """This rank's shard of the validation split (sums must be all-reduced)."""
        return self._loader(self.valid, self.valid_sampler.rank_batches(0))

    def _loader(self, dataset: PairDataset, batches: List[np.ndarray], collate_fn=None) -> Iterable[Batch]:
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=batches, collate_fn=collate_fn or self._collate,  # index arrays: no per-epoch copy
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            persistent_workers=False, prefetch_factor=4 if self.num_workers else None)

    @property
    def _collate(self):
        return packed_collate if self.packings else collate

    @property
    def _train_collate(self):
        if self._sampler_args.get("packed"):
            widths = (int(self.train.src_sizes.max(initial=0)), int(self.train.tgt_sizes.max(initial=0)))
            return packed.Collate(self.train_sampler.cap, self._sampler_args["shape_steps"], widths)
        return self._collate

    def close(self) -> None:
        """Stops the persistent loader workers and releases the splits' memory maps (the trainer calls this
        when it is done)."""
        if self._persistent is not None:
            iterator = getattr(self._persistent, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()
            self._persistent = None
        for split in (self.train, self.valid):
            if hasattr(split, "close"):
                split.close()
