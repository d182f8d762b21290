"""One optimiser step of the training loop: forward and backward over the step's micro-batches, the one
statistics all-reduce, the update. It is the hot path: nothing here reads a device value on the host
(transformer/training/loop/hotpath.py); token counts and loss sums stay on the device, the host's flags (stop,
time limit, anneal) travel with them and come back two steps late."""
import contextlib
from typing import Callable, Optional, Sequence

import torch

from transformer.dist import DistEnv
from transformer.specials import PAD
from transformer.training.components.loss import label_smoothed_cross_entropy
from transformer.training.components.optim import gradient_scale, scaled_gradients
from transformer.training.distributed.parallelize import Parallelized
from transformer.training.loop.hotpath import StepResult, StepTimer, new_stats, step_result
from transformer.training.loop.nonfinite import NonfiniteGuard
from transformer.training.speed import speedups
from transformer.training.speed.graphs import GraphStep


class TrainStep:
    """Forward/backward over K micro-batches, one gradient sync, one update. The loss is normalised by the
    target tokens of all micro-batches on all ranks, so the update equals one big batch's (Section 5.4's
    label-smoothed loss, Section 5.3's Adam and schedule).

    Args:
        parallel: what `parallelize` returned (the model, what the step calls, autocast, scaler, loss).
        optimizer, scheduler: from `build_optimizer` (capturable under trainer.cuda_graphs).
        guard: the NonfiniteGuard (trainer.nonfinite): its flag rides the statistics, Adam skips on it.
        graphs: the GraphStep under trainer.cuda_graphs, else None.
        env: the distributed environment.
        tcfg: the trainer config (label_smoothing, clip_norm, compile).
        pad_multiple: lengths padded up to it (speedups.pad_multiple).
    """

    def __init__(self, parallel: Parallelized, optimizer: torch.optim.Optimizer, scheduler, guard: NonfiniteGuard,
                 graphs: Optional[GraphStep], env: DistEnv, tcfg, pad_multiple: int):
        self.parallel, self.optimizer, self.scheduler, self.guard = parallel, optimizer, scheduler, guard
        self.model, self.net, self.scaler = parallel.model, parallel.net, parallel.scaler
        self.graphs, self.env, self.pad_multiple = graphs, env, pad_multiple
        self.timer: Optional[StepTimer] = None  # transformer-bench's phase timer
        # What every step reads, read once: walking the module tree (train(), parameters()) and reading config
        # nodes is host time that host-bound GPU steps (base, Multi30k's batches) wait for (docs/benchmarks/the-step.md,
        # "The host"). The parameters and modules are fixed once the model is parallelized.
        self.params = list(self.model.parameters())
        self.modules = list(self.net.modules())
        self.label_smoothing, self.clip_norm = tcfg.label_smoothing, tcfg.clip_norm
        self.dynamic = bool(tcfg.compile)

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
        timer, graphs, device = self.timer, self.graphs, self.env.device
        if timer is not None:
            timer.start()
        loss_sum = torch.zeros((), device=device)
        nll_sum = torch.zeros((), device=device)
        tokens = 0
        for i, batch in enumerate(micro):
            batch = speedups.prepare_batch(batch.to(device), self.pad_multiple, self.dynamic,
                                           static_shape(batch))
            if graphs is not None:  # forward, loss and backward as one CUDA graph per shape
                graphs.accumulate(batch.src, batch.tgt_in, batch.tgt_out, dropout, batch.packings)
                continue
            tokens += batch.n_tokens
            last = i == len(micro) - 1
            sync = self.net.no_sync() if (self.env.distributed and not last) else contextlib.nullcontext()
            with sync:
                with self.parallel.autocast():
                    logits = self.net(batch.src, batch.tgt_in, packings=batch.packings)  # (B, T, V)
                loss, nll = label_smoothed_cross_entropy(logits, batch.tgt_out, self.label_smoothing, PAD,
                                                         impl=self.parallel.loss, inplace=True)
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        if graphs is not None:  # gradients all-reduced (eager); the sums on the device, tokens counted there too
            tokens, loss_sum, nll_sum = graphs.reduce()
        if timer is not None:
            timer.mark("forward_backward")
        # Token count, loss sums and the stop, late, anneal and nonfinite flags travel in one tensor and one
        # all-reduce (the gradients are complete here: DDP reduced them in backward).
        stop, late, anneal = host_flags()
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = self.guard.grad_norms(grads)  # once: for the flag, and for clipping
        nonfinite = self.guard.flag(loss_sum, norms)
        stats = self.env.all_reduce_(new_stats(device, tokens, loss_sum, nll_sum, stop, late, anneal, nonfinite))
        if timer is not None:
            timer.mark("communication")
        if graphs is not None:  # normalise, clip, Adam and zero the gradients as one CUDA graph
            grad_norm = graphs.update(stats)
            self.scheduler.step()  # writes the next rate into Adam's device tensor
            if timer is not None:
                timer.mark("optimizer")
            return step_result(stats, grad_norm)
        # DDP averaged the ranks' gradients of summed losses; turn that into the gradient of the mean over tokens.
        factor = (self.env.world_size / stats[0].clamp(min=1.0)).float()
        if self.guard.can_skip:  # fused Adam applies normalisation and clipping as it reads the gradients
            scale, grad_norm = gradient_scale(norms, factor, self.clip_norm)
            with self.guard.skipping(self.optimizer, stats), scaled_gradients(self.optimizer, scale):
                self.optimizer.step()
        else:  # fp16's grad scaler (or an unfused Adam): the gradients are rescaled in place first
            self.scaler.unscale_(self.optimizer)
            torch._foreach_mul_(grads, factor)
            grad_norm = None
            if self.clip_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm).detach()
            with self.guard.skipping(self.optimizer, stats):
                self.scaler.step(self.optimizer)  # fp16 only: the scaler reads its inf check here (a sync)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if timer is not None:
            timer.mark("optimizer")
        return step_result(stats, grad_norm)
