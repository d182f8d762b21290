"""trainer.micro_batch=fit: the largest micro-batch a GPU's memory allows, at the same tokens per update.

A step's update is world_size x trainer.accumulate micro-batches of data.max_tokens tokens (padding included:
the sampler's budget). Fewer, larger micro-batches do the same update with fewer kernel launches and better
filled matrix products. Before the first step each rank probes its GPU: forward, backward and an Adam step of
the model on the worst shape a budget admits (`worst_shape`), peak memory against the GPU's total less a margin
(or an out-of-memory error). The candidates are accumulate = 1, 2, ... with the per-worker update shared among
them (every budget of data.max_tokens_by_epoch scaled alike); a binary search finds the fewest steps whose
micro-batch fits, and the ranks take the largest of their answers, so all run the same split. The choice is
stored in the checkpoint (`Trainer.micro_batch`): a resumed run reuses it and probes nothing, so its batches
are those the run started with. Without CUDA nothing is probed: one log line, the configured values.
"""
import logging
import math
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Tuple

import torch

from transformer.specials import PAD

log = logging.getLogger(__name__)
Fits = Callable[[int], bool]  # token budget -> whether a micro-batch of that budget fits in memory


@dataclass(frozen=True)
class Split:
    """One worker's share of an update: `accumulate` micro-batches of `max_tokens` (the epochs of
    data.max_tokens_by_epoch: their own budgets)."""
    max_tokens: int
    accumulate: int
    max_tokens_by_epoch: Tuple[int, ...] = ()

    @property
    def largest(self) -> int:
        return max((self.max_tokens, *self.max_tokens_by_epoch))

    @property
    def update(self) -> int:
        """Tokens per worker and update after data.max_tokens_by_epoch's ramp."""
        return self.accumulate * self.max_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "max_tokens_by_epoch": list(self.max_tokens_by_epoch)}

    @classmethod
    def from_dict(cls, d: dict) -> "Split":
        return cls(int(d["max_tokens"]), int(d["accumulate"]), tuple(int(n) for n in d["max_tokens_by_epoch"]))


def resplit(split: Split, accumulate: int) -> Split:
    """The same tokens per update over `accumulate` micro-batches: each budget b becomes
    floor(b x split.accumulate / accumulate) (never above what was probed)."""
    def share(b: int) -> int:
        return b * split.accumulate // accumulate
    return Split(share(split.max_tokens), accumulate, tuple(share(b) for b in split.max_tokens_by_epoch))


def candidates(split: Split, longest: int, tolerance: float) -> List[Split]:
    """The splits to try, fewest micro-batches (largest budget) first: accumulate = 1, 2, ... while every budget
    still holds the longest example, and only those whose update stays within `tolerance` (relative) of the
    configured one (flooring can lose a little)."""
    smallest = min((split.max_tokens, *split.max_tokens_by_epoch))
    out = []
    for k in range(1, smallest * split.accumulate // max(longest, 1) + 1):
        s = resplit(split, k)
        budgets = [(a, b) for a, b in zip((split.max_tokens, *split.max_tokens_by_epoch),
                                          (s.max_tokens, *s.max_tokens_by_epoch), strict=True)]
        if all(abs(k * b - split.accumulate * a) <= tolerance * split.accumulate * a for a, b in budgets):
            out.append(s)
    return out


def first_fit(splits: List[Split], fits: Fits) -> Optional[int]:
    """Index of the first split (largest budget) whose largest budget fits, by binary search (memory grows with
    the budget, and the budgets fall along the list); None if none fits."""
    lo, hi = 0, len(splits)  # the answer lies in [lo, hi]; hi = none
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(splits[mid].largest):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < len(splits) else None


def worst_shape(max_tokens: int, longest: int) -> Tuple[int, int]:
    """(B, T) of the probe: ceil(budget / longest) rows at the longest length. A batch of the sampler costs
    rows x its longest side <= budget, so this bounds both the per-token memory (B x T >= budget) and the
    attention's (B x T x T >= budget x any length) of every batch it can make."""
    return math.ceil(max_tokens / longest), longest


def choose(split: Split, longest: int, tolerance: float, fits: Fits, env) -> Split:
    """The split every rank will run: each rank's first fit, the largest accumulate over ranks. Collective.
    Raises ValueError (one line) when no candidate fits on some rank."""
    splits = candidates(split, longest, tolerance)
    mine = first_fit(splits, fits)
    worst = env.all_reduce_max([len(splits) if mine is None else mine])[0]
    if worst >= len(splits):
        smallest = splits[-1] if splits else split
        raise ValueError(
            f"trainer.micro_batch=fit: not even {smallest.accumulate} micro-batches of {smallest.largest} tokens "
            f"(the update of {split.accumulate} x {split.largest}, within trainer.micro_batch_tolerance="
            f"{tolerance:g}, each holding the longest example of {longest} tokens) fit in GPU memory: lower "
            "data.max_tokens or data.max_len, or set trainer.activation_checkpointing=true")
    return splits[int(worst)]


def describe(before: Split, after: Split, world_size: int, why: str) -> str:
    return (f"trainer.micro_batch=fit ({why}): data.max_tokens {before.max_tokens} -> {after.max_tokens}, "
            f"trainer.accumulate {before.accumulate} -> {after.accumulate}; tokens per update "
            f"{world_size} x {before.accumulate} x {before.max_tokens} = {world_size * before.update} -> "
            f"{world_size} x {after.accumulate} x {after.max_tokens} = {world_size * after.update}")


def fit_micro_batch(trainer, fits: Optional[Fits] = None) -> None:
    """trainer.micro_batch=fit, before the first step (the launcher and transformer-bench call it after the
    resume). `fits` replaces the GPU probe (tests). Collective on the probing path."""
    t, env = trainer.tcfg, trainer.env
    if t.micro_batch != "fit":
        return
    configured = Split(trainer.cfg.data.max_tokens, t.accumulate,
                       tuple(trainer.cfg.data.max_tokens_by_epoch))
    if trainer.micro_batch is not None:  # restored: the batches the run started with
        apply(trainer, Split.from_dict(trainer.micro_batch))
        log.info(describe(configured, Split.from_dict(trainer.micro_batch), env.world_size,
                          "as chosen when this run started, from its checkpoint"))
        return
    if trainer.step > 0:
        log.info("trainer.micro_batch=fit: resumed from a checkpoint written without it: data.max_tokens=%d and "
                 "trainer.accumulate=%d as given, so the batches stay those of the run", configured.max_tokens,
                 configured.accumulate)
        return
    if fits is None:
        if env.device.type != "cuda":
            log.info("trainer.micro_batch=fit: no CUDA device, nothing probed: data.max_tokens=%d and "
                     "trainer.accumulate=%d as given", configured.max_tokens, configured.accumulate)
            return
        fits = MemoryProbe(trainer)
    data = trainer.data.train
    longest = int(max(data.src_sizes.max(initial=1), data.tgt_sizes.max(initial=1)))  # the sampler's lengths
    asked = []
    try:
        chosen = choose(configured, longest, t.micro_batch_tolerance, lambda n: asked.append(n) or fits(n), env)
    finally:
        if isinstance(fits, MemoryProbe):
            fits.close()
    apply(trainer, chosen)
    log.info(describe(configured, chosen, env.world_size,
                      f"{len(asked)} budget(s) probed on {env.device}, {longest}-token examples at worst"))


def apply(trainer, split: Split) -> None:
    trainer.accumulate = split.accumulate
    trainer.data.set_budgets(split.max_tokens, split.max_tokens_by_epoch)
    trainer.micro_batch = split.to_dict()


def probe_batch(B: int, T: int, packed: bool):
    """A (B, T) batch without padding (every sentence T tokens, specials included), as collate makes them."""
    import numpy as np

    from transformer.data.batch import Batch
    from transformer.experimental.varlen import host_packing
    from transformer.specials import BOS, EOS, SPECIALS

    src = torch.full((B, T), len(SPECIALS), dtype=torch.long)  # (B, T) the first ordinary type
    tgt_in, tgt_out = src.clone(), src.clone()
    src[:, -1], tgt_in[:, 0], tgt_out[:, -1] = EOS, BOS, EOS
    packings = (host_packing(np.full(B, T), T),) * 2 if packed else None
    return Batch(src, tgt_in, tgt_out, torch.arange(B), B * T, packings)


class MemoryProbe:
    """fits(budget) on this rank's GPU: forward, backward and an Adam step of the trainer's own model (its
    switches: autocast, unpadded attention, activation checkpointing; eager, not compiled, which needs more
    memory, not less) on `worst_shape`, its peak reserved memory at most (1 - trainer.micro_batch_margin) of
    the GPU's. The weights are put back and the optimiser's state emptied afterwards (`close`), and the RNG
    states are untouched, so the run starts as it would have without the probe."""

    def __init__(self, trainer):
        self.trainer, self.model, self.device = trainer, trainer.model, trainer.env.device
        total = torch.cuda.get_device_properties(self.device).total_memory
        self.limit = (1 - trainer.tcfg.micro_batch_margin) * total
        self.saved = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        data = trainer.data.train
        self.longest = int(max(data.src_sizes.max(initial=1), data.tgt_sizes.max(initial=1)))

    def __call__(self, max_tokens: int) -> bool:
        from transformer.training.components.loss import label_smoothed_cross_entropy

        B, T = worst_shape(max_tokens, self.longest)
        batch = probe_batch(B, T, self.trainer.tcfg.unpadded_attention).to(self.device)
        opt = self.trainer.optimizer
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with torch.random.fork_rng(devices=[self.device]):
                self.model.train()
                with self.trainer.autocast():
                    logits = self.model(batch.src, batch.tgt_in, packings=batch.packings)  # (B, T, V)
                loss, _ = label_smoothed_cross_entropy(logits, batch.tgt_out, self.trainer.tcfg.label_smoothing,
                                                       PAD, impl=self.trainer.parallel.loss, inplace=True)
                loss.backward()
                del logits, loss
                opt.step()
                torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
            ok = peak <= self.limit
        except torch.OutOfMemoryError:
            peak, ok = None, False
        opt.zero_grad(set_to_none=True)
        del batch
        torch.cuda.empty_cache()
        log.info("trainer.micro_batch=fit: %d tokens as (%d, %d): %s", max_tokens, B, T,
                 "out of memory" if peak is None else f"peak {peak / 2**30:.1f} GiB, {'fits' if ok else 'too much'}")
        return ok

    def close(self) -> None:
        """The weights as they were before the first probe, the optimiser without state (Adam's moments and step
        count start at the first real step, as they would have)."""
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(self.saved[k])
        self.trainer.optimizer.state.clear()
        self.saved = {}
        torch.cuda.empty_cache()
