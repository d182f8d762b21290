"""One optimiser step of the training loop: forward and backward over the step's micro-batches, the one
statistics all-reduce, the update. It is the hot path: nothing here reads a device value on the host
(transformer/training/loop/hotpath.py); token counts and loss sums stay on the device, the host's flags (stop,
time limit, anneal) travel with them and come back two steps late.

Two kinds of step share that frame (`TrainStep.__call__`) and differ in how micro-batches are accumulated and
how the update is applied: `EagerStep`, kernel by kernel from Python, and `GraphedStep` (trainer.cuda_graphs),
as CUDA graphs (transformer/training/speed/graphs.py). `build_step` chooses one, once. Both run one micro-batch's
forward, loss and backward through the same function (components/loss.py `forward_backward`).
"""
import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from transformer.dist import DistEnv
from transformer.training.components.loss import forward_backward
from transformer.training.components.optim import gradient_scale, scaled_gradients
from transformer.training.distributed.parallelize import Parallelized
from transformer.training.loop.hotpath import NO_MARKS, StepResult, new_stats, step_result
from transformer.training.loop.nonfinite import NonfiniteGuard
from transformer.training.speed import speedups
from transformer.training.speed.graphs import GraphStep


class TrainStep(ABC):
    """Forward/backward over K micro-batches, one gradient sync, one update. The loss is normalised by the
    target tokens of all micro-batches on all ranks, so the update equals one big batch's (Section 5.4's
    label-smoothed loss, Section 5.3's Adam and schedule). Subclasses say how micro-batches are accumulated
    (`_accumulate`) and how the update is applied (`_update`).

    Args:
        parallel: what `parallelize` returned (the model, what the step calls, autocast, scaler, loss).
        optimizer, scheduler: from `build_optimizer` (capturable under trainer.cuda_graphs).
        guard: the NonfiniteGuard (trainer.nonfinite): its flag rides the statistics, Adam skips on it.
        env: the distributed environment.
        tcfg: the trainer config (label_smoothing, clip_norm, compile).
        pad_multiple: lengths padded up to it (speedups.pad_multiple).
        static_shapes: batches padded to the static shape the step is given (transformer/data/shapes.py).
    """

    graphs = None  # the GraphStep of a GraphedStep

    def __init__(self, parallel: Parallelized, optimizer: torch.optim.Optimizer, scheduler, guard: NonfiniteGuard,
                 env: DistEnv, tcfg, pad_multiple: int, static_shapes: bool = False):
        self.parallel, self.optimizer, self.scheduler, self.guard = parallel, optimizer, scheduler, guard
        self.tcfg = tcfg
        self.model, self.net, self.scaler = parallel.model, parallel.net, parallel.scaler
        self.env, self.device, self.pad_multiple = env, env.device, pad_multiple
        self.marks = NO_MARKS  # transformer-bench's phase timer (hotpath.StepTimer) replaces it
        # What every step reads, read once: walking the module tree (train(), parameters()) and reading config
        # nodes is host time that host-bound GPU steps (base, Multi30k's batches) wait for (docs/benchmarks/the-step.md,
        # "The host"). The parameters and modules are fixed once the model is parallelized.
        self.params = list(self.model.parameters())
        self.modules = list(self.net.modules())
        self.label_smoothing, self.clip_norm = tcfg.label_smoothing, tcfg.clip_norm
        self.dynamic = bool(tcfg.compile)
        # Batches as the loader made them need only the move to the device; padding (to a multiple or a static
        # shape, packed budgets included) and torch.compile's dynamic marks go through speedups.prepare_batch.
        reshaped = static_shapes or pad_multiple > 1 or self.dynamic
        self.prepare = self._prepared if reshaped else self._moved

    def _moved(self, batch, static_shape: Callable):
        return batch.to(self.device)

    def _prepared(self, batch, static_shape: Callable):
        return speedups.prepare_batch(batch.to(self.device), self.pad_multiple, self.dynamic, static_shape(batch))

    def _train_mode(self) -> None:
        """net.train() when any module is not in training mode (validation left it in eval): the check reads
        one attribute a module; train() itself sets it through every module's __setattr__."""
        if not all(m.training for m in self.modules):
            self.net.train()

    def __call__(self, micro: Sequence, static_shape: Callable, dropout: float,
                 host_flags: Callable[[], tuple]) -> StepResult:
        """`micro`: the step's CPU batches; `static_shape(batch)`: the (rows, S, T) it is padded to, or None;
        `dropout`: the model's P_drop now (a CUDA graph per rate); `host_flags()`: (stop, late, anneal), read
        once the micro-batches are queued."""
        self._train_mode()
        self.marks.start()
        tokens, loss_sum, nll_sum = self._accumulate(micro, static_shape, dropout)
        self.marks.mark("forward_backward")
        # Token count, loss sums and the stop, late, anneal and nonfinite flags travel in one tensor and one
        # all-reduce (the gradients are complete here: DDP, or GraphStep.reduce, summed them over the ranks).
        stop, late, anneal = host_flags()
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = self.guard.grad_norms(grads)  # once: for the flag, and for clipping
        nonfinite = self.guard.flag(loss_sum, norms)
        stats = self.env.all_reduce_(new_stats(self.device, tokens, loss_sum, nll_sum, stop, late, anneal,
                                               nonfinite))
        self.marks.mark("communication")
        grad_norm = self._update(stats, grads, norms)
        self.marks.mark("optimizer")
        return step_result(stats, grad_norm)

    @abstractmethod
    def _accumulate(self, micro: Sequence, static_shape: Callable, dropout: float) -> tuple:
        """Forward and backward of every micro-batch; returns this rank's (target tokens, loss sum, nll sum)."""

    @abstractmethod
    def _update(self, stats: torch.Tensor, grads: list, norms):
        """Normalise, clip, step Adam and the schedule, zero the gradients; returns the gradient norm or None."""


class EagerStep(TrainStep):
    """The step kernel by kernel: DDP's hooks reduce the gradients in the last micro-batch's backward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the micro-batches before the last skip DDP's gradient sync; one worker has nothing to skip
        self.no_sync = self.net.no_sync if self.env.distributed else contextlib.nullcontext
        # fused Adam applies normalisation and clipping as it reads the gradients; fp16's grad scaler (or an
        # unfused Adam) needs them rescaled in place first
        self._step_optimizer = self._fused_update if self.guard.can_skip else self._scaled_update

    def _accumulate(self, micro: Sequence, static_shape: Callable, dropout: float) -> tuple:
        sums = [torch.zeros((), device=self.device), torch.zeros((), device=self.device)]  # loss, nll
        tokens = 0
        for batch in micro[:-1]:
            with self.no_sync():  # DDP reduces the gradients in the last micro-batch's backward only
                tokens += self._forward_backward(batch, static_shape, sums)
        tokens += self._forward_backward(micro[-1], static_shape, sums)
        return tokens, *sums

    def _forward_backward(self, batch, static_shape: Callable, sums: list) -> int:
        """One micro-batch: its loss and nll added into `sums`, its gradients into `.grad`; returns its tokens."""
        batch = self.prepare(batch, static_shape)
        loss, nll = forward_backward(self.net, self.parallel.autocast, batch.src, batch.tgt_in, batch.tgt_out,
                                     batch.packings, self.label_smoothing, self.parallel.loss, self.scaler.scale)
        sums[0] += loss
        sums[1] += nll
        return batch.n_tokens

    def _update(self, stats: torch.Tensor, grads: list, norms):
        # DDP averaged the ranks' gradients of summed losses; turn that into the gradient of the mean over tokens.
        factor = (self.env.world_size / stats[0].clamp(min=1.0)).float()
        grad_norm = self._step_optimizer(stats, grads, norms, factor)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _fused_update(self, stats, grads, norms, factor):
        scale, grad_norm = gradient_scale(norms, factor, self.clip_norm)
        with self.guard.skipping(self.optimizer, stats), scaled_gradients(self.optimizer, scale):
            self.optimizer.step()
        return grad_norm

    def _scaled_update(self, stats, grads, norms, factor):
        self.scaler.unscale_(self.optimizer)
        torch._foreach_mul_(grads, factor)
        grad_norm = None
        if self.clip_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm).detach()
        with self.guard.skipping(self.optimizer, stats):
            self.scaler.step(self.optimizer)  # fp16 only: the scaler reads its inf check here (a sync)
        return grad_norm


class GraphedStep(TrainStep):
    """trainer.cuda_graphs: forward, loss and backward as one CUDA graph per static shape, the gradients
    all-reduced eagerly, the update as one more graph (transformer/training/speed/graphs.py). On a CPU (tests
    only: parallelize refuses cuda_graphs there) the same code runs eagerly."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graphs = GraphStep(self.model, self.net, self.optimizer, self.parallel.autocast, self.tcfg, self.guard,
                                self.env, capture=self.device.type == "cuda", loss=self.parallel.loss)

    def _accumulate(self, micro: Sequence, static_shape: Callable, dropout: float) -> tuple:
        for batch in micro:
            batch = self.prepare(batch, static_shape)
            self.graphs.accumulate(batch.src, batch.tgt_in, batch.tgt_out, dropout, batch.packings)
        # gradients all-reduced (eager); the sums on the device, tokens counted there too
        return self.graphs.reduce()

    def _update(self, stats: torch.Tensor, grads: list, norms):
        grad_norm = self.graphs.update(stats)  # normalise, clip, Adam and zero the gradients as one CUDA graph
        self.scheduler.step()  # writes the next rate into Adam's device tensor
        return grad_norm


def build_step(parallel: Parallelized, optimizer: torch.optim.Optimizer, scheduler, guard: NonfiniteGuard,
               env: DistEnv, tcfg, pad_multiple: int, static_shapes: bool) -> TrainStep:
    """The kind of step the run takes, chosen here once: CUDA graphs under trainer.cuda_graphs, else eager."""
    kind = GraphedStep if tcfg.cuda_graphs else EagerStep
    return kind(parallel, optimizer, scheduler, guard, env, tcfg, pad_multiple, static_shapes)
