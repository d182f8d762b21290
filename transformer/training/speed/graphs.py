"""CUDA graphs of the training step (trainer.cuda_graphs): the step replayed as a few recorded kernel sequences
instead of about a thousand launches from Python.

The step is split where it must talk to the host or to the other ranks:
1. per micro-batch, one graph per static shape (transformer/data/shapes.py) runs forward, loss and backward,
   adding into gradient buffers that never move (`.grad` of every parameter: views of one flat buffer,
   allocated once) and into device sums (target tokens, counted on the device; loss; nll). Nothing in it
   depends on a Python number that changes per step: the batch is copied into the graph's own input tensors
   before each replay.
2. eagerly: with several workers, one all-reduce (sum) of the flat gradient buffer (NCCL, or gloo in the CPU
   tests; no DDP wrapper, whose hooks cannot sit in a graph); then the non-finite flag, the step's statistics
   tensor and its all-reduce (the trainer's code).
3. one graph for the update: gradients (summed over ranks) divided by the step's tokens of all ranks (read on
   the device), clipping,
   fused Adam with `capturable=True` and the learning rate as a device tensor (NoamSchedule writes it with
   fill_ before the replay), skipping on the device when the step was not finite, then the gradient buffers
   and sums zeroed for the next step.
`capture=False` runs the same code eagerly (the CPU tests compare it with the ordinary step).

Warm-up runs on a side stream before each capture, as torch requires. Warm-up must not change the run: the
gradients and sums accumulated so far are saved and put back, and so is the CUDA RNG state; the update's
warm-up runs with the non-finite flag up, so fused Adam creates its state but moves nothing. Dropout inside a
graph draws from the default CUDA generator, which torch registers with every capture: each replay advances
its offset as the eager kernels would, so the RNG state saved in checkpoints stays exact.
One graph is kept per (shape, dropout rate): the rate is a kernel argument, and trainer.dropout_by_epoch
changes it. All graphs share one memory pool (they never run at the same time). Capture errors only on this
thread's unsafe calls ("thread_local"): the DataLoader's pin-memory thread keeps working meanwhile.
"""
import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from transformer.config import ConfigError
from transformer.experimental.varlen import Packing
from transformer.specials import PAD
from transformer.training.components.loss import forward_backward
from transformer.training.components.optim import gradient_scale, scaled_gradients

WARMUP = 3  # eager iterations on a side stream before a capture (torch's documented pattern)


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    """What backward runs on in a graph: the loss itself (no fp16 grad scaler: the update graph refuses one)."""
    return loss


def _layout(packings) -> Optional[tuple]:
    """The host numbers of a packed batch's packings, (max_len, B, T) a side: fixed per static shape."""
    return None if packings is None else tuple((p.max_len, p.B, p.T) for p in packings)


def check_cuda_graphs(tcfg, device: torch.device) -> None:
    """What trainer.cuda_graphs cannot run on, refused before anything is built (transformer/config.py
    refuses the conflicting keys)."""
    if tcfg.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"trainer.cuda_graphs=true: needs a CUDA device, this run is on {device.type}; "
                          "set speed=eager or trainer.cuda_graphs=false (trainer.static_shapes=true alone works "
                          "everywhere)")


class GraphStep:
    """Forward/backward per micro-batch and the update, captured (or, with capture=False, run eagerly).

    Args:
        model: the plain module (its parameters get static gradient buffers).
        net: what the forward calls (model, or its compiled form).
        optimizer: fused Adam built with capturable=True and a device-tensor learning rate
            (transformer/training/components/optim.py build_optimizer(capturable=True)).
        autocast: the forward's autocast context factory.
        tcfg: the trainer config (label_smoothing, loss, clip_norm).
        guard: the NonfiniteGuard whose `skipping` makes fused Adam skip a non-finite step on the device.
        env: the distributed environment: its all_reduce_ sums the flat gradient buffer over the workers.
        capture: record CUDA graphs; False runs the same code eagerly (CPU tests).
    """

    def __init__(self, model: torch.nn.Module, net, optimizer: torch.optim.Optimizer, autocast, tcfg, guard,
                 env, capture: bool = True, loss: str = "fused"):
        self.net, self.optimizer, self.autocast, self.tcfg, self.guard = net, optimizer, autocast, tcfg, guard
        self.env, self.capture, self.loss = env, capture, loss  # loss: trainer.loss as parallelize chose it
        self.params = [p for p in model.parameters() if p.requires_grad]
        device = self.params[0].device
        self.device = device
        if len({p.dtype for p in self.params}) != 1:
            raise RuntimeError("trainer.cuda_graphs keeps the gradients in one flat buffer: parameters of one dtype")
        # static gradient buffers, views of one flat tensor: backward adds into them in place, one all-reduce
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype, device=device)
        offset = 0
        for p in self.params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.loss_sum = torch.zeros((), device=device)
        self.nll_sum = torch.zeros((), device=device)
        self.stats: Optional[torch.Tensor] = None  # the update's input: a copy of the step's statistics
        self.grad_norm = torch.zeros((), device=device)
        self.micro: Dict[tuple, Tuple[torch.cuda.CUDAGraph, Tuple[torch.Tensor, ...]]] = {}
        self.update_graph: Optional[torch.cuda.CUDAGraph] = None
        self.pool = None  # the memory pool all graphs share

    @property
    def grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.params]

    def reduce(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the step's micro-batches: the gradients summed over the workers (one all-reduce, eager), and
        this worker's (target tokens, loss sum, nll sum) on the device."""
        self.env.all_reduce_(self.flat)
        return self.tokens, self.loss_sum, self.nll_sum

    # ---- per micro-batch ---------------------------------------------------------------------------
    def accumulate(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, dropout: float,
                   packings: Optional[Tuple[Packing, Packing]] = None) -> None:
        """Adds one statically shaped micro-batch's gradients and sums: src (R, S), tgt_in/tgt_out (R, T), or a
        packed batch (transformer/experimental/packed.py), src (N_s,), tgt_in/tgt_out (N_t,), and its packings, whose
        tensors are graph inputs too and whose widths (fixed per shape) are part of the key."""
        tensors = (src, tgt_in, tgt_out, *(t for p in packings or () for t in (p.index, p.cu_seqlens, p.lengths)))
        layout = _layout(packings)
        if not self.capture:
            self._forward_backward(*tensors, layout=layout)
            return
        key = (*(tuple(t.shape) for t in tensors), layout, dropout)
        if key not in self.micro:
            self.micro[key] = self._capture_micro(tensors, layout)
        graph, inputs = self.micro[key]
        for static, x in zip(inputs, tensors, strict=True):
            static.copy_(x)
        graph.replay()

    def _forward_backward(self, src, tgt_in, tgt_out, *packed, layout=None) -> None:
        packings = None
        if layout is not None:  # the packings rebuilt around this call's (static) tensors
            packings = tuple(Packing(*packed[3 * i:3 * i + 3], *layout[i]) for i in range(2))
        loss, nll = forward_backward(self.net, self.autocast, src, tgt_in, tgt_out, packings,
                                     self.tcfg.label_smoothing, self.loss, _unscaled)  # (R, T) or (N_t,) targets
        self.loss_sum += loss
        self.nll_sum += nll
        self.tokens += (tgt_out != PAD).sum()

    def _capture_micro(self, tensors, layout):
        inputs = tuple(t.clone() for t in tensors)
        graph = torch.cuda.CUDAGraph()
        with self._unchanged([self.flat, self.tokens, self.loss_sum, self.nll_sum]):
            self._warm_up(lambda: self._forward_backward(*inputs, layout=layout))
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward_backward(*inputs, layout=layout)
        self.pool = graph.pool()
        return graph, inputs

    # ---- the update --------------------------------------------------------------------------------
    def update(self, stats: torch.Tensor) -> Optional[torch.Tensor]:
        """The step's update from its all-reduced statistics (hotpath.STATS); returns the gradient norm before
        clipping (a tensor of its own) when trainer.clip_norm is set. Zeroes the gradients and sums."""
        if self.stats is None:
            self.stats = torch.zeros_like(stats)
        self.stats.copy_(stats)
        if not self.capture:
            self._update()
        else:
            if self.update_graph is None:
                self.update_graph = self._capture_update()
            self.update_graph.replay()
        return self.grad_norm.clone() if self.tcfg.clip_norm is not None else None

    def _update(self) -> None:
        # gradients of losses summed over all tokens of all workers -> the gradient of the mean over those tokens,
        # and clipped: one scale that fused Adam applies as it reads them (the ordinary step's arithmetic)
        factor = (1.0 / self.stats[0].clamp(min=1.0)).float()
        clip = self.tcfg.clip_norm
        norms = torch._foreach_norm(self.grads) if clip is not None else None  # only clipping reads them here
        scale, grad_norm = gradient_scale(norms, factor, clip)
        if grad_norm is not None:
            self.grad_norm.copy_(grad_norm)
        with self.guard.skipping(self.optimizer, self.stats), scaled_gradients(self.optimizer, scale):
            self.optimizer.step()
        self.flat.zero_()
        for t in (self.tokens, self.loss_sum, self.nll_sum):
            t.zero_()

    def _capture_update(self) -> torch.cuda.CUDAGraph:
        if not self.guard.can_skip:
            raise RuntimeError("trainer.cuda_graphs needs fused Adam that skips on the device (no grad scaler)")
        graph = torch.cuda.CUDAGraph()
        kept = [self.flat, self.stats, self.grad_norm, self.tokens, self.loss_sum, self.nll_sum]
        with self._unchanged(kept):
            self.stats[-1].fill_(1.0)  # not finite: Adam creates its state (outside the graph) and moves nothing
            self._warm_up(self._update)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._update()
        self.pool = graph.pool()
        return graph

    # ---- capture helpers ---------------------------------------------------------------------------
    def _warm_up(self, fn) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    @contextlib.contextmanager
    def _unchanged(self, tensors: List[torch.Tensor]):
        """Warm-up and capture leave `tensors`, the CUDA RNG state and the gradient buffers' storage as they were."""
        saved = [t.clone() for t in tensors]
        rng = torch.cuda.get_rng_state(self.device)
        where = [g.data_ptr() for g in self.grads]
        yield
        torch.cuda.synchronize(self.device)
        if [g.data_ptr() for g in self.grads] != where:
            raise RuntimeError("a captured backward replaced a gradient buffer instead of adding into it")
        torch._foreach_copy_(tensors, saved)
        torch.cuda.set_rng_state(rng, self.device)
