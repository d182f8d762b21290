"""Starting the workers of a run: one per device, spawned by this process or started by torchrun.

- plain: `transformer-train trainer.devices=N` spawns N workers (torch.multiprocessing) after the config
  has been composed and validated in this parent process;
- torchrun: every process is a worker; RANK, LOCAL_RANK and WORLD_SIZE come from the environment and
  nothing is spawned.
Global rank 0 owns the run directory; other ranks never write into it. A worker reports how it ended by
its exit code alone (`transformer.exit_codes`); the message of a user error travels through the
rendezvous store, so the parent prints it once.
"""
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.multiprocessing as mp

from transformer import dist, exit_codes
from transformer.atomic import remove_pending, write_text_atomic
from transformer.config import ConfigError, from_container, to_container
from transformer.data import build_data
from transformer.data.download import DownloadError
from transformer.environment import describe, machine_error
from transformer.experimental import in_use
from transformer.experimental.microbatch import fit_micro_batch
from transformer.tasks import build_task
from transformer.training.components.checkpoint import (
    ORIGIN,
    CheckpointError,
    changed_settings,
    load_checkpoint,
    same_file,
)
from transformer.training.components.init_from import (
    FREE_AT_INIT,
    InitFrom,
    check_tokenizer,
    prepare_init_from,
    read_init_from,
)
from transformer.training.distributed.parallelize import build_model, parallelize
from transformer.training.distributed.runlock import end_with_parent
from transformer.training.loop.trainer import Trainer
from transformer.training.reporting.logs import setup_logging, start_file_log, warn
from transformer.training.speed import speedups

log = logging.getLogger("transformer")
JOIN_GRACE_S = 10.0  # spawn path: seconds the other workers get to exit after one has
# Bad input (config values, corpora, downloads, checkpoints): one line and exit code 2, not a traceback.
USER_INPUT_ERRORS = (ValueError, ConfigError, CheckpointError, FileNotFoundError, DownloadError)


def num_workers(cfg) -> int:
    if cfg.trainer.devices != "auto":
        return int(cfg.trainer.devices)
    if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def worker(rank: int, local_rank: int, world_size: int, cfg_dict: dict, run_dir: Optional[str],
           store: Optional[torch.distributed.Store] = None, snapshot: Optional[Dict[str, str]] = None,
           local_world_size: int = 1) -> int:
    """One training process: wires data, model, task and trainer, then trains. `run_dir` and `snapshot` (the
    .hydra/ files) are given to global rank 0 only. Returns the exit code."""
    stop = StopRequest()  # from here on a stop signal ends the run cleanly, whatever it is doing
    cfg = from_container(cfg_dict)
    env = dist.init(rank, local_rank, world_size, cfg.trainer.accelerator, cfg.trainer.timeout_s, store)
    run_dir = Path(run_dir) if (run_dir is not None and env.is_main) else None
    setup_logging(run_dir)
    threads = set_threads(cfg.trainer.threads, local_world_size)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed + rank)  # different dropout masks per rank; restored exactly on resume
    try:  # the process that decides about run_dir holds its lock (transformer/cli/train.py, runlock.py)
        return _train(cfg, env, run_dir, snapshot, stop, threads)  # its objects are gone when dist.close() runs
    finally:
        stop.close()
        dist.close()


def _train(cfg, env: dist.DistEnv, run_dir: Optional[Path], snapshot: Optional[Dict[str, str]], stop: "StopRequest",
           threads: int) -> int:
    init = prepare_init_from(cfg)  # trainer.init_from: its weights and tokenizer
    data = build_data(cfg, env, run_dir, init.tokenizer_state if init is not None else None)
    check_tokenizer(init, data.tokenizer)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg, data)
    torch.manual_seed(cfg.seed + env.rank)
    trainer = Trainer(cfg, env, parallelize(model, cfg, env), data, build_task(cfg), run_dir, stop)
    restore(trainer, cfg, env, init)
    fit_micro_batch(trainer)  # trainer.micro_batch=fit: probes the GPU, or reuses the checkpoint's choice
    if run_dir is not None:  # accepted: only now is the run directory written to
        accept(run_dir, snapshot or {}, trainer)
    # what trainer.precision=auto resolved to: the CPU kind (or GPU) decides it, and reports need it
    log.info("%d worker(s) on %s, %d CPU thread(s) each, %s | model %.2fM parameters | run dir %s", env.world_size,
             env.device, threads, speedups.compute_type(trainer.amp_dtype, env.device),
             sum(p.numel() for p in model.parameters()) / 1e6, run_dir)
    experimental = in_use(cfg.trainer)
    if experimental:
        warn(f"experimental, not yet timed on a GPU (docs/performance.md): {', '.join(experimental)}")
    try:
        code = trainer.train()
    except BaseException as e:  # the experiment trackers record the failure too
        code = (exit_codes.ENVIRONMENT if machine_error(e, run_dir) else exit_codes.USER_ERROR
                if isinstance(e, USER_INPUT_ERRORS) else exit_codes.INTERNAL)
        trainer.metrics.close(code)
        raise
    trainer.close(code)
    return code


class StopRequest:
    """SIGTERM / SIGUSR1 (Slurm's warning signal) and a first Ctrl-C (SIGINT) set a flag instead of killing the
    process: the trainer finishes its step, checkpoints and exits with code 3; before training has started
    there is nothing to save and the run ends at once with the same code. A second Ctrl-C ends the process
    at once with code 130, writing nothing (`abort`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.signum: Optional[int] = None
        self._first: Optional[float] = None  # monotonic time of the first stop signal
        self._old = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if second_ctrl_c(signum, self._first):
            abort()
        if self._first is not None:
            return
        self._first = time.monotonic()
        hint = " (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""
        log.warning("received %s: stopping at the next safe point%s", signal.Signals(signum).name, hint)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def close(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# One Ctrl-C in a terminal reaches a worker twice: directly (the whole foreground process group gets it) and
# through its launcher (the spawn parent or the torchrun agent, which forward it). Signals this close together
# are one keypress; a second keypress comes later.
SAME_CTRL_C_S = 1.0


def second_ctrl_c(signum: int, first: Optional[float]) -> bool:
    """A SIGINT that comes more than SAME_CTRL_C_S after the first stop signal: the user's second Ctrl-C."""
    return signum == signal.SIGINT and first is not None and time.monotonic() - first > SAME_CTRL_C_S


def abort() -> None:
    """Ends this process at once, from a signal handler: no checkpoint, no flushed log, no cleanup but the
    temporary file of a write it interrupts (a checkpoint being saved), so nothing is left half-written."""
    remove_pending()
    if dist.get_env().is_main:
        os.write(2, b"aborted by a second Ctrl-C: nothing written since the last checkpoint; rerun the same "
                    b"command to resume from it\n")
    os._exit(exit_codes.ABORTED)


def set_threads(requested: Optional[int], local_workers: int) -> int:
    """torch's intra-op threads: `trainer.threads`, else OMP_NUM_THREADS where the launcher or the user set
    it, else the cores this process may run on (its affinity mask, which Slurm and taskset set) shared among
    the workers of this node. torch's default (every core of the machine in every worker) oversubscribes
    the cores and slows training several times over (docs/benchmarks/code-choices.md)."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    threads = requested or (int(omp) if omp.isdigit() and int(omp) > 0 else
                            max(1, len(os.sched_getaffinity(0)) // max(local_workers, 1)))
    torch.set_num_threads(threads)
    return threads


@dist.rank_zero
def accept(run_dir: Path, snapshot: Dict[str, str], trainer: Trainer) -> None:
    """The run starts: its log goes to train.log, .hydra/ records the config, and temporary files that
    killed writes of earlier attempts left in checkpoints/ are removed."""
    start_file_log(run_dir)
    for name, text in snapshot.items():
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / ".hydra" / name, text)
    if trainer.checkpointer is not None:
        for path in trainer.checkpointer.remove_stale_temp_files():
            log.warning("removed %s, left by an interrupted checkpoint write", path)


def restore(trainer: Trainer, cfg, env: dist.DistEnv, init: Optional[InitFrom] = None) -> None:
    """trainer.resume: auto = the run directory's newest good checkpoint (rank 0 picks it, all load it;
    multi-node runs need the run directory on a shared file system), none, or a path, which only starts the
    run: a rerun takes the newest checkpoint the run directory holds since (`Checkpointer.resume_from`)."""
    resume, path, ckpt, why = cfg.trainer.resume, None, None, ""
    ck = trainer.checkpointer
    if resume == "auto":
        found = ck.find_resume() if ck is not None else None
        path = env.broadcast_object(str(found[0]) if found else None)
        ckpt = found[1] if found else None  # rank 0 has read it already
    elif resume != "none":
        path, ckpt, why = ck.resume_from(resume) if ck is not None else (resume, None, "")
        path = env.broadcast_object(path)
    if path is not None:
        ckpt = ckpt if ckpt is not None else load_checkpoint(path)
        trainer.load_state_dict(ckpt, path)
        log.info("resumed from %s at step %d (epoch %d, batch %d)%s", path, trainer.step, trainer.epoch,
                 trainer.batch_index, f": {why}" if why else "")
        changed = changed_settings(ckpt.get("config", {}), to_container(cfg))
        if changed:  # the weights, optimiser and RNG states continue; the new values apply from here on
            warn(f"resumed with settings other than those {path} was trained with: {'; '.join(changed)}. "
                 "The run goes on with the new values; an exact continuation needs the old ones")
    elif cfg.trainer.init_from:
        init = init if init is not None else read_init_from(cfg.trainer.init_from)
        trainer.load_weights(init.weights, init.path, free=FREE_AT_INIT)
        log.info("initialised weights and tokenizer from %s (%s)", init.path, init.which)
    if ck is not None:
        started = resume not in ("auto", "none") and same_file(path, resume)  # a line of training starts here
        ck.origin = {"path": os.path.realpath(resume), "step": trainer.step} if started else (ckpt or {}).get(ORIGIN)
        ck.started_at = trainer.step
        later = ck.later_files()
        if later:
            warn(f"{ck.folder} holds checkpoints after step {trainer.step}, of another line of training than this "
                 f"run's ({', '.join(p.name for p in later)}): this run's first checkpoint removes them")


def _spawned(local_rank: int, world_size: int, cfg_dict: dict, run_dir: str, port: int,
             snapshot: Dict[str, str]) -> None:
    end_with_parent()  # the parent holds the run's lock: no worker may outlive it
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False)
    try:
        main = local_rank == 0
        code = worker(local_rank, local_rank, world_size, cfg_dict, run_dir if main else None, store,
                      snapshot if main else None, local_world_size=world_size)
    except Exception as e:  # one line for the parent to print: bad input, or the machine's fault
        machine = machine_error(e, Path(run_dir))
        if machine is None and not isinstance(e, USER_INPUT_ERRORS):
            raise
        store.set(f"error/{local_rank}", describe(machine, Path(run_dir)) if machine else str(e))
        code = exit_codes.ENVIRONMENT if machine else exit_codes.USER_ERROR
    if code:
        sys.exit(code)


def spawn(n: int, cfg_dict: dict, run_dir: Path, snapshot: Dict[str, str]) -> int:
    """Starts n workers on this machine; a failing worker brings the others down (no hang). Returns the
    exit code of the run; a user error's message is printed once, as one `error:` line."""
    setup_logging(None)  # this parent's own errors go to stderr like rank 0's (Hydra's handler writes to stdout)
    # The parent hosts the rendezvous store on a port the kernel picks: no fixed port, no race for one.
    store = torch.distributed.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False)
    ctx = mp.start_processes(_spawned, args=(n, cfg_dict, str(run_dir), store.port, snapshot), nprocs=n, join=False,
                             start_method="spawn")

    first = []  # monotonic time of the first stop signal

    def forward(signum, frame):  # SLURM/Ctrl-C reach the parent: pass the stop request on to the workers
        again = second_ctrl_c(signum, first[0] if first else None)  # passed on as SIGINT: the workers abort
        first[:] = first or [time.monotonic()]
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signum if again or signum != signal.SIGINT else signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    try:
        # After the first worker exits non-zero, give the others a moment to exit on their own (on a stop
        # signal rank 0 may still be closing its logs when rank 1 has exited with code 3) before
        # SIGTERM, then SIGKILL.
        while not ctx.join(grace_period=JOIN_GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code in (exit_codes.PREEMPTED, exit_codes.ABORTED, exit_codes.DIVERGED):
            return e.exit_code  # rank 0 has said why in one line
        if e.exit_code in (exit_codes.USER_ERROR, exit_codes.ENVIRONMENT):
            key = f"error/{e.error_index}"
            why = store.get(key).decode() if store.check([key]) else f"worker {e.error_index}: bad input"
            # No advice to rerun: the same command would fail the same way.
            print(f"error: {why}", file=sys.stderr)
            return e.exit_code
        log.error("worker %d died (%s); the other workers were stopped. Rerun the same command with "
                  "hydra.run.dir=%s to resume from its last checkpoint", e.error_index, _why(e), run_dir)
        return exit_codes.INTERNAL
    except mp.ProcessRaisedException as e:  # a bug: the worker's traceback follows
        log.error("worker %d failed:\n%s\nRerun with hydra.run.dir=%s to resume", e.error_index, e, run_dir)
        return exit_codes.INTERNAL
    return exit_codes.OK


def _why(e: "mp.ProcessExitedException") -> str:
    if e.signal_name:
        return f"killed by {e.signal_name}"
    return f"exit code {e.exit_code}"


def launch(cfg_dict: dict, run_dir: Path, torchrun: Optional[dict], snapshot: Dict[str, str]) -> int:
    """Runs the workers of a validated config: this process is one of torchrun's, or the only worker, or the
    parent of `num_workers` spawned ones. `snapshot` holds the .hydra/ files rank 0 writes once the run
    is accepted."""
    if torchrun is not None:
        main = torchrun["rank"] == 0
        return worker(torchrun["rank"], torchrun["local_rank"], torchrun["world_size"], cfg_dict,
                      str(run_dir) if main else None, snapshot=snapshot if main else None,
                      local_world_size=torchrun["local_world_size"])
    n = num_workers(from_container(cfg_dict))
    if n == 1:
        return worker(0, 0, 1, cfg_dict, str(run_dir), snapshot=snapshot)
    return spawn(n, cfg_dict, run_dir, snapshot)
