"""Non-finite loss or gradients (trainer.nonfinite): skip the update, and stop a run that keeps diverging.

Detection adds no host sync: each step's flag (its loss sum or a gradient norm is inf/NaN) rides the step's
statistics all-reduce (transformer/training/loop/hotpath.py), so every rank sees the same value, and the fused Adam
reads it on the device as `found_inf`, skipping the update (moments and step count untouched) exactly as fp16
loss scaling does. The host reads the flag one step late, with the stop flag, and counts the non-finite steps
in a row; past trainer.nonfinite_skips (at once for `stop`) it raises `Diverged` at the same step on every rank.

Weights therefore stay finite; `check_weights` still refuses to write a checkpoint of non-finite weights (an
optimizer that cannot skip on the device, a weight average), so last.pt, best.pt and the average never hold one.
With precision=fp16 the grad scaler owns gradient overflows (it skips them and lowers its scale): only the
loss counts there.
"""
import contextlib
import logging
from typing import Iterable, List, Optional

import torch

log = logging.getLogger(__name__)


class Diverged(Exception):
    """The run must stop; `why` says which steps were not finite (or that the weights are not)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class NonfiniteGuard:
    def __init__(self, tcfg, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
        self.scaler_owns_grads = scaler.is_enabled()
        # fused Adam takes a device-side found_inf; the scaler passes its own when it is on
        self.can_skip = bool(optimizer.defaults.get("fused")) and not self.scaler_owns_grads
        self.max_skips = tcfg.nonfinite_skips if tcfg.nonfinite == "skip" and (self.can_skip or
                                                                                  self.scaler_owns_grads) else 0
        self.in_a_row = 0
        self.first: Optional[int] = None  # first step of the current run of non-finite steps

    def flag(self, loss_sum: torch.Tensor, norms: Optional[List[torch.Tensor]]) -> torch.Tensor:
        """0-dim bool on the device: this rank's loss sum or gradients are not finite (queued, not read).
        `norms`: the gradients' norms (`grad_norms`), None where the fp16 grad scaler owns overflows."""
        parts = [loss_sum.detach().float().view(1)]
        if norms:
            parts.append(torch.stack(norms).float())
        return ~torch.isfinite(torch.cat(parts)).all()

    def grad_norms(self, grads: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Each gradient's norm (one pass over them), for the flag and, with fused Adam, for clipping; None
        where the fp16 grad scaler checks the gradients itself."""
        return None if self.scaler_owns_grads or not grads else torch._foreach_norm(grads)

    @contextlib.contextmanager
    def skipping(self, optimizer: torch.optim.Optimizer, stats: torch.Tensor):
        """The optimizer step inside skips its update where the all-reduced flag (`stats[-1]`) is up."""
        if not self.can_skip:
            yield
            return
        optimizer.found_inf = (stats[-1] > 0).float()
        try:
            yield
        finally:
            del optimizer.found_inf

    def observe(self, nonfinite: bool, step: int) -> None:
        """`step`'s flag, read `LaggedFlag.lag` steps late; raises Diverged once too many came in a row."""
        if not nonfinite:
            self.in_a_row, self.first = 0, None
            return
        self.in_a_row += 1
        self.first = step if self.first is None else self.first
        if self.in_a_row > self.max_skips:
            steps = f"step {step}" if self.first == step else f"steps {self.first}-{step}"
            raise Diverged(f"the loss or gradients were not finite at {steps} ({self.in_a_row} in a row, more than "
                           f"trainer.nonfinite_skips={self.max_skips})")
        log.warning("step %d: the loss or gradients are not finite: update skipped (%d in a row, the run stops after "
                    "trainer.nonfinite_skips=%d)", step, self.in_a_row, self.max_skips)


def check_weights(tensors: Iterable[torch.Tensor], step: int) -> None:
    """Raises Diverged if any tensor holds inf/NaN (one host sync: called before a checkpoint is written)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    if flags and not bool(torch.stack(flags).all()):
        raise Diverged(f"the weights are not finite at step {step} (not saved)")


def diverged_line(why: str, step: int, lr: float, last: Optional[str]) -> str:
    return (f"training diverged: {why}; stopped at step {step}, learning rate {lr:.4g}; last finite checkpoint: "
            f"{last or 'none'} (last.pt and best.pt are finite). Lower optim.factor or raise optim.warmup (or set "
            "trainer.clip_norm), then resume from it with trainer.resume=PATH or start a new run; exit code 4")
