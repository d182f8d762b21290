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
from pathlib import Path
from typing import Optional

import torch
import torch.multiprocessing as mp

from transformer import dist, exit_codes
from transformer.config import ConfigError, from_container
from transformer.data import build_data
from transformer.data.download import DownloadError
from transformer.model import Transformer
from transformer.tasks import build_task
from transformer.training.checkpoint import CheckpointError, load_checkpoint
from transformer.training.logs import setup_logging
from transformer.training.trainer import Trainer

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
           store: Optional[torch.distributed.Store] = None) -> int:
    """One training process: wires data, model, task and trainer, then trains. `run_dir` is given to global
    rank 0 only. Returns the exit code."""
    cfg = from_container(cfg_dict)
    env = dist.init(rank, local_rank, world_size, cfg.trainer.accelerator, cfg.trainer.timeout_s, store)
    run_dir = Path(run_dir) if (run_dir is not None and env.is_main) else None
    setup_logging(run_dir)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed + rank)  # different dropout masks per rank; restored exactly on resume
    try:
        data = build_data(cfg, env, run_dir)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = Transformer.from_config(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
        torch.manual_seed(cfg.seed + rank)
        trainer = Trainer(cfg, env, model, data, build_task(cfg), run_dir)
        restore(trainer, cfg, env)
        log.info("%d worker(s) on %s | model %.2fM parameters | run dir %s", world_size, env.device,
                 sum(p.numel() for p in model.parameters()) / 1e6, run_dir)
        code = trainer.train()
        trainer.close()
        return code
    finally:
        dist.close()


def restore(trainer: Trainer, cfg, env: dist.DistEnv) -> None:
    """trainer.resume: auto = the run directory's newest good checkpoint (rank 0 picks it, all load it;
    multi-node runs need the run directory on a shared file system), none, or a path."""
    resume, path, ckpt = cfg.trainer.resume, None, None
    if resume == "auto":
        found = trainer.checkpointer.find_resume() if trainer.checkpointer is not None else None
        path = env.broadcast_object(str(found[0]) if found else None)
        ckpt = found[1] if found else None  # rank 0 has read it already
    elif resume != "none":
        path = resume
    if path is not None:
        trainer.load_state_dict(ckpt if ckpt is not None else load_checkpoint(path), path)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, trainer.step, trainer.epoch,
                 trainer.batch_index)
    elif cfg.trainer.init_from:
        trainer.load_weights(load_checkpoint(cfg.trainer.init_from), cfg.trainer.init_from)
        log.info("initialised weights from %s", cfg.trainer.init_from)


def _spawned(local_rank: int, world_size: int, cfg_dict: dict, run_dir: str, port: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False)
    try:
        code = worker(local_rank, local_rank, world_size, cfg_dict, run_dir if local_rank == 0 else None, store)
    except USER_INPUT_ERRORS as e:
        store.set(f"error/{local_rank}", str(e))
        code = exit_codes.USER_ERROR
    if code:
        sys.exit(code)


def spawn(n: int, cfg_dict: dict, run_dir: Path) -> int:
    """Starts n workers on this machine; a failing worker brings the others down (no hang). Returns the
    exit code of the run; a user error's message is printed once, as one `error:` line."""
    setup_logging(None)  # this parent's own errors go to stderr like rank 0's (Hydra's handler writes to stdout)
    # The parent hosts the rendezvous store on a port the kernel picks: no fixed port, no race for one.
    store = torch.distributed.TCPStore("127.0.0.1", 0, n + 1, is_master=True, wait_for_workers=False)
    ctx = mp.start_processes(_spawned, args=(n, cfg_dict, str(run_dir), store.port), nprocs=n, join=False,
                             start_method="spawn")

    def forward(signum, frame):  # SLURM/Ctrl-C reach the parent: pass the stop request on to the workers
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    try:
        # After the first worker exits non-zero, give the others a moment to exit on their own (on a stop
        # signal rank 0 may still be closing its logs when rank 1 has exited with code 3) before
        # SIGTERM, then SIGKILL.
        while not ctx.join(grace_period=JOIN_GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code == exit_codes.PREEMPTED:
            return exit_codes.PREEMPTED
        if e.exit_code == exit_codes.USER_ERROR:
            key = f"error/{e.error_index}"
            why = store.get(key).decode() if store.check([key]) else f"worker {e.error_index}: bad input"
            # No advice to rerun: the same command would fail the same way.
            print(f"error: {why}", file=sys.stderr)
            return exit_codes.USER_ERROR
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


def launch(cfg_dict: dict, run_dir: Path, torchrun: Optional[dict]) -> int:
    """Runs the workers of a validated config: this process is one of torchrun's, or the only worker, or the
    parent of `num_workers` spawned ones."""
    if torchrun is not None:
        return worker(torchrun["rank"], torchrun["local_rank"], torchrun["world_size"], cfg_dict,
                      str(run_dir) if torchrun["rank"] == 0 else None)
    n = num_workers(from_container(cfg_dict))
    if n == 1:
        return worker(0, 0, 1, cfg_dict, str(run_dir))
    return spawn(n, cfg_dict, run_dir)
