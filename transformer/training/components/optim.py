"""Adam and the learning-rate schedule of Section 5.3, with an optional linear fall to zero at the end."""
import contextlib
from typing import List, Optional, Tuple

import torch


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), Equation (3); step counts from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class NoamSchedule:
    """Sets the rate of every parameter group; stepped once per optimiser step, never per micro-batch
    (the Annotated Transformer steps per micro-batch, so with accumulation its warmup is shorter than it says).

    `optim.anneal` > 0: over the run's last fraction the Noam rate is multiplied by a factor falling linearly
    from 1 to 0 (warmup-stable-decay). The inverse square root alone never anneals, so the last weights are
    noisy; a fall to zero settles them. `start_anneal` fixes where the fall begins and how many steps it takes;
    both are in the checkpoint, so a resumed run falls exactly as an uninterrupted one."""

    def __init__(self, optimizer: torch.optim.Optimizer, d_model: int, warmup: int, factor: float,
                 anneal: float = 0.0):
        self.optimizer, self.d_model, self.warmup, self.factor = optimizer, d_model, warmup, factor
        self.anneal = anneal
        self.step_num = 0
        self.anneal_start: Optional[int] = None  # the step at which the fall begins
        self.anneal_steps = 0
        self._apply()

    def lr(self) -> float:
        rate = noam_lr(self.step_num + 1, self.d_model, self.warmup, self.factor)
        if self.anneal_start is None or self.step_num < self.anneal_start:
            return rate
        return rate * max(0.0, 1.0 - (self.step_num - self.anneal_start) / self.anneal_steps)

    def start_anneal(self, start: int, steps: int) -> None:
        self.anneal_start, self.anneal_steps = start, max(int(steps), 1)
        self._apply()

    def plan_anneal(self, max_steps: Optional[int]) -> None:
        """A run of known length (trainer.max_steps) falls over its last `anneal * max_steps` steps."""
        if self.anneal > 0 and max_steps is not None and self.anneal_start is None:
            steps = max(round(self.anneal * max_steps), 1)
            self.start_anneal(max_steps - steps, steps)

    def anneal_now(self, steps: int) -> None:
        """A run of known minutes (trainer.max_minutes): called at the step whose clock passed
        (1 - anneal) * max_minutes, with the steps the rest of the time should buy (`fall_steps`). With
        max_steps too, whichever point comes first."""
        if self.anneal > 0 and not self.falling:
            self.start_anneal(self.step_num, steps)

    @property
    def falling(self) -> bool:
        """The fall has begun (a max_steps plan still ahead has not)."""
        return self.anneal_start is not None and self.anneal_start <= self.step_num

    @property
    def anneal_end(self) -> Optional[int]:
        """The step at which the rate reaches zero, once the fall is planned."""
        return None if self.anneal_start is None else self.anneal_start + self.anneal_steps

    @property
    def annealed(self) -> bool:
        """The fall has reached zero: further steps would not move the weights."""
        return self.anneal_end is not None and self.step_num >= self.anneal_end

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # capturable Adam (CUDA graphs): written in place, no sync
                group["lr"].fill_(self.lr())
            else:
                group["lr"] = self.lr()

    def step(self) -> None:
        self.step_num += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_num": self.step_num, "anneal_start": self.anneal_start, "anneal_steps": self.anneal_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step_num = int(state["step_num"])
        # A fall already begun is kept (absent from checkpoints of earlier versions); optim.anneal=0 drops it.
        if self.anneal > 0 and state.get("anneal_start") is not None:
            self.anneal_start, self.anneal_steps = int(state["anneal_start"]), int(state["anneal_steps"])
        self._apply()


def fall_steps(anneal: float, epoch: int, batch_index: int, accumulate: int, batches_of) -> int:
    """The steps that the last `anneal` of the minutes should buy, from where the fall starts: batch
    `batch_index` of `epoch`; `batches_of(e)` is epoch e's batch count. The pace is counted in epochs, not in
    steps: an epoch takes about the same minutes whatever its token budget, while the steps of a batch ramp's
    small early epochs are quick, so the pace in steps so far plans a fall that the time left cannot finish
    (the rate then ends well above 0: docs/multi30k.md)."""
    batches = batches_of(epoch)
    left = (epoch + batch_index / batches) * anneal / (1 - anneal)  # epochs the rest of the time covers
    steps, share = 0.0, 1 - batch_index / batches  # the part of `epoch` still ahead
    while True:
        take = min(share, left)
        steps += take * batches / accumulate
        left -= take
        if left <= 1e-9:  # ends here: the next epoch's count (perhaps a new budget to plan) is not needed
            return max(round(steps), 1)
        epoch += 1
        batches, share = batches_of(epoch), 1.0


def build_optimizer(model: torch.nn.Module, cfg_optim, d_model: int, capturable: bool = False):
    """Adam(beta1=0.9, beta2=0.98, eps=1e-9) with the Noam schedule. Tied weights appear once in parameters().
    `capturable` (trainer.cuda_graphs): state and learning rate live on the device, so the step can be
    captured in a CUDA graph; the schedule writes the rate into its tensor before each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    # Fused Adam: one kernel over all parameters, on CPUs too (torch >= 2.4), several times faster than the
    # per-tensor loop (docs/benchmarks/switches.md).
    kwargs = {"fused": True} if params and params[0].device.type in ("cuda", "cpu") else {}
    lr = 0.0
    if capturable:
        kwargs["capturable"] = True
        lr = torch.zeros((), device=params[0].device)
    opt = torch.optim.Adam(params, lr=lr, betas=(cfg_optim.beta1, cfg_optim.beta2), eps=cfg_optim.eps,
                           weight_decay=cfg_optim.weight_decay, **kwargs)
    return opt, NoamSchedule(opt, d_model, cfg_optim.warmup, cfg_optim.factor, cfg_optim.anneal)


def gradient_scale(norms: Optional[List[torch.Tensor]], factor: torch.Tensor,
                   clip_norm: Optional[float]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The one multiplier of a step's gradients: `factor` turns the gradients of summed losses into those of the
    mean over the step's tokens, and trainer.clip_norm's coefficient (clip_grad_norm_'s formula) scales them to
    at most that norm. `norms`: each gradient's norm before either, computed once a step for the non-finite
    flag too (unread, and may be None, without clipping). Returns (scale, the normalised gradient's norm before
    clipping, None without clipping). Fused Adam applies the scale as it reads each gradient
    (`scaled_gradients`): where normalising, then clip_grad_norm_, made three more passes over every gradient,
    this makes none."""
    if clip_norm is None:
        return factor, None
    grad_norm = torch.linalg.vector_norm(torch.stack(norms)) * factor  # (): the norm after normalising
    return factor * (clip_norm / (grad_norm + 1e-6)).clamp(max=1.0), grad_norm


@contextlib.contextmanager
def scaled_gradients(optimizer: torch.optim.Optimizer, scale: torch.Tensor):
    """The fused Adam step inside reads every gradient times `scale` (a device tensor: nothing is read on the
    host). Through Adam's `grad_scale`, which divides (as unscaling for the fp16 grad scaler does), so it gets
    the reciprocal; the scaled gradients are written back into `.grad`."""
    optimizer.grad_scale = scale.reciprocal()
    try:
        yield
    finally:
        del optimizer.grad_scale


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, keeping this run's own `lr` object (a device tensor under
    trainer.cuda_graphs, else a number), `capturable` and `fused`: the checkpoint's groups would replace
    them, and a checkpoint written with or without CUDA graphs resumes under either setting."""
    own = [{k: g[k] for k in ("lr", "capturable", "fused") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keep in zip(optimizer.param_groups, own, strict=True):
        group.update(keep)
