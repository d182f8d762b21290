"""Rank-aware console logging, and the metrics sinks: metrics.jsonl, TensorBoard and the console line.

Rank 0 logs INFO and up to the console and to <run_dir>/train.log. Other ranks log only warnings
and errors, prefixed with their global rank, so problems on any worker still reach the console.
train.log is written only once the run is accepted (`start_file_log`): until then its lines wait in
memory, so a run refused while starting leaves an existing run directory untouched.
"""
import json
import logging
import logging.handlers
import math
import os
import sys
import time
from pathlib import Path

import torch

from transformer.dist import get_env, rank_zero

log = logging.getLogger("transformer")


@rank_zero
def warn(message: str) -> None:
    """A warning logged once for the run (global rank 0), not once per worker."""
    log.warning(message)


@rank_zero
def note(message: str) -> None:
    log.info(message)


def setup_logging(run_dir: Path | None) -> None:
    env = get_env()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = "[%(asctime)s] %(message)s" if env.is_main else f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s"
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root.addHandler(console)
    root.setLevel(logging.INFO if env.is_main else logging.WARNING)
    if env.is_main and run_dir is not None:
        # Never flushed by itself: start_file_log() hands its lines to train.log.
        root.addHandler(logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1))


@rank_zero
def start_file_log(run_dir: Path) -> None:
    """The run is accepted: the lines logged so far, and all later ones, go to <run_dir>/train.log."""
    root = logging.getLogger()
    fh = _FileHandler(Path(run_dir) / "train.log")
    fh.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    for h in list(root.handlers):
        if isinstance(h, logging.handlers.MemoryHandler):
            h.setTarget(fh)
            h.flush()
            root.removeHandler(h)
            h.close()
    root.addHandler(fh)


class _FileHandler(logging.FileHandler):
    """train.log: a line that cannot be written (a full disk) is dropped silently, as the console has it, instead
    of logging's traceback per line; the run's next checkpoint or metrics write reports the disk."""

    def handleError(self, record) -> None:
        pass


def gpu_stats(device: torch.device) -> dict:
    """Peak memory from the caching allocator, utilisation from NVML (nvidia-ml-py)."""
    if device.type != "cuda":
        return {}
    stats = {"gpu_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    try:
        # Not pynvml's index = torch's index: under CUDA_VISIBLE_DEVICES=2,3 (SLURM sets it) torch's cuda:0 is
        # NVML's GPU 2. torch.cuda.utilization maps through CUDA_VISIBLE_DEVICES (ordinals or UUIDs).
        stats["gpu_util"] = float(torch.cuda.utilization(device))
    except Exception:  # NVML missing in some containers: memory alone is still worth logging
        pass
    return stats


class MetricsLogger:
    """Rank 0 writes every event to metrics.jsonl (one JSON object a line) and to the trackers of
    `cfg.logger.trackers` (TensorBoard by default; wandb, mlflow: transformer/training/reporting/trackers.py); others do
    nothing. `close(code)` records how the run ended in the trackers."""

    def __init__(self, run_dir: Path | None, cfg=None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.file = None
        self.writer = None
        self.trackers = None  # wandb/mlflow, once opened
        self.start = time.time()
        self.cfg = cfg
        self.tensorboard = cfg is None or "tensorboard" in cfg.logger.trackers

    def _open(self) -> None:
        """On the first event, so a run that fails while starting leaves no empty metrics files."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            from transformer.environment import quiet_thread_faults

            quiet_thread_faults()
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._open_trackers()

    def _open_trackers(self) -> None:
        if self.trackers is None and self.cfg is not None and self.run_dir is not None:
            from transformer.config import to_container
            from transformer.training.reporting.trackers import open_trackers

            self.trackers = []  # a tracker that fails to start is not retried at every event
            self.trackers = open_trackers(self.cfg.logger, self.run_dir, to_container(self.cfg))

    @rank_zero
    def log(self, split: str, step: int, epoch: int, **values) -> None:
        if self.file is None and self.run_dir is not None:
            self._open()
        record = {"split": split, "step": step, "epoch": epoch, "elapsed_s": round(time.time() - self.start, 3)}
        record.update({k: (float(v) if isinstance(v, (float, int)) and not isinstance(v, bool) else v)
                       for k, v in values.items()})
        if self.file is not None:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
                os.fsync(self.file.fileno())
            except OSError as e:  # a full disk: name the file (transformer/environment.py reports it)
                e.filename = e.filename or self.file.name
                raise
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{split}/{k}", v, step)
        if self.trackers:
            from transformer.training.reporting.trackers import numeric

            for tracker in self.trackers:
                tracker.log(split, step, numeric(values))
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        log.info("%s step %d epoch %d | %s", split, step, epoch, shown)

    @rank_zero
    def close(self, code: int = 0) -> None:
        """`code`: the run's exit code (transformer/exit_codes.py). A run that fails before its first event
        still gets a tracker run saying so (only trackers: no empty metrics.jsonl)."""
        if code and self.trackers is None and self.run_dir is not None and self.run_dir.is_dir():
            self._open_trackers()
        if self.trackers:
            from transformer.training.reporting.trackers import close_quietly

            for tracker in self.trackers:
                close_quietly(tracker, code)
        self.trackers = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


class Progress:
    """A tqdm bar on rank 0 (step, loss, lr, tokens/s, ETA); nothing on other ranks."""

    def __init__(self, total: int | None, initial: int, enabled: bool):
        self.bar = None
        self._open(total, initial, enabled)

    @rank_zero
    def _open(self, total, initial, enabled) -> None:
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0,
                            file=sys.stderr, disable=None)

    @rank_zero
    def update(self, **postfix) -> None:
        """One step done; `postfix` (when given) replaces the values shown after the bar."""
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)
            self.bar.update(1)

    @rank_zero
    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
