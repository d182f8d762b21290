"""What keeps the training step free of host-device synchronisation.

On a GPU every `.item()`, `float(tensor)` or `.tolist()` stalls the CPU until the GPU has drained its
queue, and the GPU then idles while the CPU prepares the next kernels. So the step's statistics stay
on the device: one float64 tensor per step, `(target tokens, loss sum, nll sum, stop, late, anneal, nonfinite)`,
all-reduced once (NCCL enqueues it; nothing waits), summed into a `TrainWindow` on the device and read only when a
line is logged. The gradients are normalised by its token count as a device tensor. The stop flag
(SIGTERM/SIGUSR1 seen by any rank) is read through `LaggedFlag` two steps late: at the end of step s the
host reads the flag of step s-2, copied to pinned host memory while steps s-1 and s were being queued, so
the GPU has two steps of work in hand and the host waits only if it ran more than two steps ahead (each
such wait is counted: `LaggedFlag.waits`). Every rank reads the same all-reduced value after the same
step, so all ranks stop together, at most three steps after the signal arrived. The late flag (some rank's run clock
past `trainer.max_minutes`) and the anneal flag (past the point where `optim.anneal` starts the rate's fall)
sit beside it and are read in the same copy, so all ranks end the run, and start the fall, at the same step;
so does the nonfinite flag (some rank's loss or the gradients are inf/NaN: transformer/training/loop/nonfinite.py).
"""
import contextlib
import time
from collections import deque
from typing import Deque, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

STATS = ("tokens", "loss", "nll", "stop", "late", "anneal", "nonfinite")  # the entries of a step's statistics tensor


class StepResult(NamedTuple):
    """One optimiser step's outcome; the tensors live on the training device (0-dim views of `stats`)."""
    tokens: torch.Tensor  # target tokens of the global batch (all micro-batches, all ranks)
    loss: torch.Tensor  # label-smoothed loss summed over those tokens
    nll: torch.Tensor
    grad_norm: Optional[torch.Tensor]  # total gradient norm before clipping (trainer.clip_norm set)
    stats: torch.Tensor  # (7,) float64: tokens, loss, nll, stop, late, anneal, nonfinite

    @property
    def flags(self) -> torch.Tensor:
        """(4,) (stop, late, anneal, nonfinite), each > 0 when any rank raised it at this step: a stop signal
        received, the run clock past trainer.max_minutes, past (1 - optim.anneal) * max_minutes, a loss or
        gradient not finite. Read as one by LaggedFlag."""
        return self.stats[3:]


def new_stats(device: torch.device, tokens: Union[int, torch.Tensor], loss: torch.Tensor, nll: torch.Tensor,
              stop: bool, late: bool = False, anneal: bool = False,
              nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(7,) float64 on `device`. Python numbers enter through fill_ (a kernel argument, not a host-to-device
    copy from pageable memory, which would wait for the GPU); the sums, and a token count kept on the device
    (trainer.cuda_graphs), are device-to-device copies."""
    stats = torch.empty(len(STATS), dtype=torch.float64, device=device)
    if isinstance(tokens, torch.Tensor):
        stats[0].copy_(tokens)
    else:
        stats[0].fill_(tokens)
    stats[1].copy_(loss)
    stats[2].copy_(nll)
    stats[3].fill_(float(stop))
    stats[4].fill_(float(late))
    stats[5].fill_(float(anneal))
    if nonfinite is None:
        stats[6].fill_(0.0)
    else:
        stats[6].copy_(nonfinite)
    return stats


def step_result(stats: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> StepResult:
    return StepResult(stats[0], stats[1], stats[2], grad_norm, stats)


class LoopKeys(NamedTuple):
    """The config keys the training loop reads every step, read once: each read of an OmegaConf node is
    host time that a host-bound GPU step waits for (docs/benchmarks/the-step.md, "The host")."""
    max_steps: Optional[int]
    max_epochs: Optional[int]
    max_minutes: Optional[float]
    anneal: float  # optim.anneal
    log_every: int
    val_every: int
    every_steps: int  # checkpoint.every_steps
    max_sentences: Optional[int]  # data.max_sentences
    shape_steps: int

    @classmethod
    def of(cls, cfg) -> "LoopKeys":
        t = cfg.trainer
        return cls(t.max_steps, t.max_epochs, t.max_minutes, cfg.optim.anneal, t.log_every, t.val_every,
                   cfg.checkpoint.every_steps, cfg.data.max_sentences, t.shape_steps)


class TrainWindow:
    """Sums of the steps since the last logged line: tokens, loss and nll on the device, steps and the
    start time on the host. `read()` is the one synchronisation per logged line. Validation and checkpoint
    writes between its steps are `exclude`d from its training time (a line's tokens/s is the steps' own) but
    kept in its wall time (what the time left is estimated from)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums: Optional[torch.Tensor] = None
        self.steps = 0
        self.time = time.time()
        self.excluded = 0.0  # seconds of validation and checkpoints since `time`

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def add(self, result: StepResult) -> None:
        part = result.stats[:3]
        self.sums = part.clone() if self.sums is None else self.sums.add_(part)
        self.steps += 1

    def read(self, grad_norm: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """{tokens, loss, nll[, grad_norm], steps, elapsed, wall}: one device-to-host copy for all of them.
        elapsed: the steps' seconds; wall: the same with the excluded pauses."""
        parts = [self.sums if self.sums is not None else torch.zeros(3, dtype=torch.float64)]
        if grad_norm is not None:
            parts.append(grad_norm.detach().to(parts[0].device, torch.float64).view(1))
        values = torch.cat(parts).tolist()
        out = dict(zip(("tokens", "loss", "nll", "grad_norm"), values, strict=False))
        wall = time.time() - self.time  # after the copy: the GPU caught up
        out.update(steps=self.steps, elapsed=max(wall - self.excluded, 0.0), wall=wall)
        return out


@contextlib.contextmanager
def paused(window: TrainWindow, clock, kind: str, device: torch.device):
    """Validation or a checkpoint write between training steps: its seconds are kept out of `window`'s training
    time and added to `clock`'s pauses of `kind` (quality.RunClock). The steps already queued on a GPU finish
    first, on the steps' side of the line (validation would wait for them at its first read anyway)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.time()
    try:
        yield
    finally:
        seconds = time.time() - start
        window.exclude(seconds)
        clock.add_pause(kind, seconds)


class LaggedFlag:
    """Device flags read `lag` pushes late without draining the GPU's queue: `push(flag)` starts an
    asynchronous copy of `flag` (0-dim, or a vector of flags) into a pinned host buffer (a ring of `lag` of
    them) and returns the value pushed `lag` pushes before (all False until then). It waits on that copy's
    CUDA event only when the copy has not finished yet, that is when the host is more than `lag` steps ahead
    of the GPU: `waits` counts those host syncs, `reads` all reads. On the CPU the flag itself is kept and
    read. A value is True where > 0: a bool for a 0-dim flag, a tuple of bools for a vector. The value
    returned never depends on timing, so every rank decides the same at the same push."""

    def __init__(self, lag: int = 2):
        if lag < 1:
            raise ValueError(f"lag={lag}: must be >= 1")
        self.lag = lag
        self._pending: Deque[Tuple[torch.Tensor, Optional[object]]] = deque()  # (host tensor, event or None)
        self._free: List[torch.Tensor] = []  # pinned buffers whose value has been read
        self.waits = self.reads = 0

    def push(self, flag: torch.Tensor) -> Union[bool, Tuple[bool, ...]]:
        if len(self._pending) >= self.lag:
            previous = self._read()
        else:
            previous = _positive([0.0] * flag.numel(), flag.dim())
        self._pending.append(self._start_copy(flag))
        return previous

    def _start_copy(self, flag: torch.Tensor) -> Tuple[torch.Tensor, Optional[object]]:
        if not flag.is_cuda:
            return flag, None
        host = self._free.pop() if self._free else torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _read(self) -> Union[bool, Tuple[bool, ...]]:
        host, event = self._pending.popleft()
        self.reads += 1
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        value = _positive(host.reshape(-1).tolist(), host.dim())  # a host tensor by now: no device round trip
        if event is not None:
            self._free.append(host)  # its value is read: the next copy may reuse it
        return value


def _positive(values: List[float], dim: int) -> Union[bool, Tuple[bool, ...]]:
    flags = tuple(v > 0 for v in values)
    return flags if dim else flags[0]


class NoMarks:
    """The step's phase marks when nothing times them (every run but `transformer-bench`'s): StepTimer's
    `start()` and `mark(phase)`, doing nothing, so the step calls them unconditionally."""

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


NO_MARKS = NoMarks()


class StepTimer:
    """Where a step's time goes, for `transformer-bench`, which puts it in place of the step's `marks` (NoMarks):
    the step calls `start()`, then `mark(phase)` at each phase's end.
    CUDA events on a GPU (recorded on the stream, read once by `summary()`, so timing adds no sync),
    perf_counter on the CPU, where kernels run synchronously. The host's own clock is read at every mark too
    (`host_summary()`): on a GPU, the time the host took to queue each phase, which, with the data wait, says
    whether the host or the device sets the step's pace."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: List[list] = []  # per step: (phase, device event or None, host seconds)

    def _now(self) -> tuple:
        host = time.perf_counter()
        if not self.cuda:
            return None, host
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, host

    def start(self) -> None:
        self.steps.append([("start", *self._now())])

    def mark(self, phase: str) -> None:
        if self.steps:
            self.steps[-1].append((phase, *self._now()))

    def summary(self) -> Dict[str, float]:
        """Mean milliseconds per step of each phase (from its previous mark to its own): device time on a GPU."""
        if self.cuda:
            torch.cuda.synchronize()
            return self._mean(lambda a, b: a[1].elapsed_time(b[1]))
        return self.host_summary()

    def host_summary(self) -> Dict[str, float]:
        """Mean milliseconds per step the host spent in each phase (on a CPU, the same as `summary()`)."""
        return self._mean(lambda a, b: 1e3 * (b[2] - a[2]))

    def _mean(self, ms_between) -> Dict[str, float]:
        totals: Dict[str, float] = {}
        for marks in self.steps:
            for a, b in zip(marks, marks[1:], strict=False):
                totals[b[0]] = totals.get(b[0], 0.0) + ms_between(a, b)
        n = max(len(self.steps), 1)
        return {phase: ms / n for phase, ms in totals.items()}
