"""`transformer-train` / `python -m transformer.train`: compose the config, then train on 1..N workers.

Launch paths, one code path:
- plain: `transformer-train trainer.devices=N` spawns N workers (torch.multiprocessing) after Hydra
  has composed and validated the config in this parent process;
- torchrun: `torchrun --nproc-per-node=N -m transformer.train ...`: every process is a worker; RANK,
  LOCAL_RANK and WORLD_SIZE come from the environment and nothing is spawned.
Global rank 0 owns the run directory; other ranks never write into it.
"""
import logging
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
import torch
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from transformer import dist
from transformer.atomic import write_text_atomic
from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.config import ConfigError, from_container, register_configs, to_container, validate
from transformer.data import build_data
from transformer.data.download import DownloadError
from transformer.logs import setup_logging
from transformer.model import Transformer
from transformer.trainer import PREEMPTED_EXIT_CODE, Trainer

# HF tokenizers' thread pool does not survive DataLoader workers forking after encoding; it says so noisily.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
log = logging.getLogger("transformer")
_RUN_NAME: Optional[str] = None
JOIN_GRACE_S = 10.0  # spawn path: seconds the other workers get to exit after one has
# Bad input (config values, corpora, downloads, checkpoints): one line and exit code 2, not a traceback.
BAD_INPUT = (ValueError, CheckpointError, FileNotFoundError, DownloadError)
BAD_INPUT_NAMES = {c.__name__ for c in BAD_INPUT} | {"ConfigError"}  # as a spawned worker's traceback names them


def run_name() -> str:
    """Default run-directory name. Under torchrun it is the rendezvous id, so restarts after a crash
    (which rerun this entry point) land in the same directory and resume; otherwise a timestamp plus a
    random suffix, so two jobs started in the same second never share a directory."""
    global _RUN_NAME
    if _RUN_NAME is None:
        rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        _RUN_NAME = (f"torchrun-{rdzv}" if rdzv != "none"
                     else time.strftime("%Y-%m-%d/%H-%M-%S-") + secrets.token_hex(3))
    return _RUN_NAME


def num_workers(cfg: DictConfig) -> int:
    if cfg.trainer.devices != "auto":
        return int(cfg.trainer.devices)
    if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def worker(rank: int, local_rank: int, world_size: int, cfg_dict: dict, run_dir: Optional[str],
           store_port: Optional[int] = None) -> int:
    """One training process. `run_dir` is given to global rank 0 only."""
    cfg = from_container(cfg_dict)
    store = None
    if store_port is not None:
        store = torch.distributed.TCPStore("127.0.0.1", store_port, world_size, is_master=False)
    env = dist.init(rank, local_rank, world_size, cfg.trainer.accelerator, cfg.trainer.timeout_s, store)
    run_dir = Path(run_dir) if (run_dir is not None and env.is_main) else None
    setup_logging(run_dir)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed + rank)  # different dropout masks per rank; restored exactly on resume
    try:
        data = build_data(cfg, env, run_dir)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = Transformer(cfg.model, data.src_vocab_size, data.tgt_vocab_size, data.shared_vocab)
        torch.manual_seed(cfg.seed + rank)
        trainer = Trainer(cfg, env, model, data, run_dir)
        restore(trainer, cfg, env)
        log.info("%d worker(s) on %s | model %.2fM parameters | run dir %s", world_size, env.device,
                 sum(p.numel() for p in model.parameters()) / 1e6, run_dir)
        code = trainer.train()
        trainer.close()
        return code
    finally:
        dist.close()


def restore(trainer: Trainer, cfg: DictConfig, env: dist.DistEnv) -> None:
    """trainer.resume: auto = the run directory's newest good checkpoint (rank 0 picks it, all load it;
    multi-node runs need the run directory on a shared file system), none, or a path."""
    resume = cfg.trainer.resume
    path = None
    if resume == "auto":
        found = trainer.checkpointer.find_resume() if trainer.checkpointer is not None else None
        path = env.broadcast_object(str(found[0]) if found else None)
    elif resume != "none":
        path = resume
    if path is not None:
        trainer.load_state_dict(load_checkpoint(path), path)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, trainer.step, trainer.epoch,
                 trainer.batch_index)
    elif cfg.trainer.init_from:
        trainer.load_weights(load_checkpoint(cfg.trainer.init_from), cfg.trainer.init_from)
        log.info("initialised weights from %s", cfg.trainer.init_from)


def _spawned(local_rank: int, world_size: int, cfg_dict: dict, run_dir: str, port: int) -> None:
    code = worker(local_rank, local_rank, world_size, cfg_dict, run_dir if local_rank == 0 else None, port)
    if code:
        sys.exit(code)


def spawn(n: int, cfg_dict: dict, run_dir: Path) -> int:
    """Starts n workers on this machine; a failing worker brings the others down (no hang)."""
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
        if e.exit_code == PREEMPTED_EXIT_CODE:
            return PREEMPTED_EXIT_CODE
        log.error("worker %d died (%s); the other workers were stopped. Rerun the same command with "
                  "hydra.run.dir=%s to resume from its last checkpoint", e.error_index, _why(e), run_dir)
        return 1
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]  # "module.ErrorClass: message" of the worker's traceback
        name, _, message = last.partition(": ")
        if name.rsplit(".", 1)[-1] in BAD_INPUT_NAMES:
            # Bad input, as main() reports it on one worker: one line, exit code 2, and no advice to
            # rerun (the same command would fail the same way).
            print(f"error: {message}", file=sys.stderr)
            return 2
        log.error("worker %d failed: %s. Rerun with hydra.run.dir=%s to resume", e.error_index, last, run_dir)
        return 1
    return 0


def _why(e: "mp.ProcessExitedException") -> str:
    if e.signal_name:
        return f"killed by {e.signal_name}"
    return f"exit code {e.exit_code}"


@dist.rank_zero
def write_config_snapshot(run_dir: Path, cfg: DictConfig) -> None:
    """.hydra/{config,overrides,hydra}.yaml, written only once the config has been validated."""
    folder = run_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    hc = HydraConfig.get()
    for name, node in (("config.yaml", cfg), ("overrides.yaml", OmegaConf.create(list(hc.overrides.task))),
                       ("hydra.yaml", OmegaConf.create({"hydra": OmegaConf.to_container(hc, resolve=False)}))):
        write_text_atomic(folder / name, OmegaConf.to_yaml(node))


def run(cfg: DictConfig) -> int:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torchrun = dist.torchrun_env()
    # Hydra has just made the run directory (other torchrun ranks point it at "."). If it was empty, this run
    # owns it: a run refused for bad input removes it again, so a failed start leaves nothing half-written.
    owned = (torchrun is None or torchrun["rank"] == 0) and run_dir.is_dir() and not any(run_dir.iterdir())
    try:
        code = launch(cfg, run_dir, torchrun)
    except BAD_INPUT as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if code == 2 and owned:
        _remove_run_dir(run_dir)
    return code


def launch(cfg: DictConfig, run_dir: Path, torchrun: Optional[dict]) -> int:
    validate(cfg)
    for key in ("resume", "init_from"):
        value = cfg.trainer[key]
        if value not in (None, "auto", "none") and not Path(value).is_file():
            raise ConfigError(f"trainer.{key}={value!r}: no such checkpoint file")
    cfg_dict = to_container(cfg)
    if torchrun is not None:
        if torchrun["rank"] == 0:
            write_config_snapshot(run_dir, cfg)
        return worker(torchrun["rank"], torchrun["local_rank"], torchrun["world_size"], cfg_dict,
                      str(run_dir) if torchrun["rank"] == 0 else None)
    write_config_snapshot(run_dir, cfg)
    n = num_workers(cfg)
    if n == 1:
        return worker(0, 0, 1, cfg_dict, str(run_dir))
    return spawn(n, cfg_dict, run_dir)


def _remove_run_dir(folder: Path) -> None:
    """Removes a run directory this run made and that holds no results yet (never the working directory), and
    for a default name (outputs/<date>/<time>-<id>) the folders above it that are left empty."""
    for handler in list(logging.getLogger().handlers):  # train.log is open in it
        if isinstance(handler, logging.FileHandler):
            logging.getLogger().removeHandler(handler)
            handler.close()
    if folder.resolve() == Path.cwd().resolve() or any((folder / f).exists() for f in ("checkpoints", "metrics.jsonl")):
        return  # it has results: a late error never deletes them
    shutil.rmtree(folder, ignore_errors=True)
    if _RUN_NAME is not None and folder.as_posix().endswith(_RUN_NAME):
        cwd = Path.cwd().resolve()
        for parent in folder.resolve().parents:  # outputs/<date>/, then outputs/, while empty and below cwd
            if cwd not in parent.parents:
                break
            try:
                parent.rmdir()
            except OSError:  # holds other runs
                break


# An absolute path: a relative one is read as a Python package and fails outside the repository root.
@hydra.main(config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    register_configs()
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    rank = dist.torchrun_env()
    if rank is not None and rank["rank"] != 0:
        # Non-zero torchrun ranks still run Hydra (to compose the same config) but must write nothing.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/hydra_logging=none"]
    _hydra_main()


if __name__ == "__main__":
    main()
