"""`transformer-train` (also `python -m transformer.train`): compose the config, validate it, then run the
workers (transformer/training/launcher.py) and exit with the contract's code (transformer/exit_codes.py)."""
import logging
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from transformer import dist, exit_codes, version_line
from transformer.cli.compose import precheck
from transformer.config import CONF_DIR, ConfigError, register_configs, to_container
from transformer.config_checks import validate
from transformer.environment import describe, machine_error
from transformer.experimental import fp8
from transformer.tasks import build_task
from transformer.training.distributed.runlock import RunLock
from transformer.training.launcher import USER_INPUT_ERRORS, launch

# HF tokenizers' thread pool does not survive DataLoader workers forking after encoding; it says so noisily.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_RUN_NAME: Optional[str] = None


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


def check(cfg: DictConfig) -> None:
    """Everything about the config that can be checked before any worker starts (and, through `precheck`,
    before Hydra makes the run directory)."""
    validate(cfg)
    build_task(cfg).metric(cfg.checkpoint.best_metric)
    for key in ("resume", "init_from"):
        value = cfg.trainer[key]
        if value in (None, "auto", "none") or Path(value).is_file():
            continue
        if key == "init_from" and Path(value).is_dir():  # a Hugging Face model folder (transformer/interop/hf.py)
            continue
        raise ConfigError(f"trainer.{key}={value!r}: no such checkpoint file"
                          + (" or Hugging Face model folder" if key == "init_from" else ""))
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator='gpu': torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    fp8.check(cfg.trainer)  # trainer.precision=fp8 where it cannot run: before the run directory is made


def config_snapshot(cfg: DictConfig) -> dict:
    """.hydra/{config,overrides,hydra}.yaml: rank 0 writes them once the run is accepted."""
    hc = HydraConfig.get()
    nodes = (("config.yaml", cfg), ("overrides.yaml", OmegaConf.create(list(hc.overrides.task))),
             ("hydra.yaml", OmegaConf.create({"hydra": OmegaConf.to_container(hc, resolve=False)})))
    return {name: OmegaConf.to_yaml(node) for name, node in nodes}


# A run that ends with these codes before it has results takes back what it made (nothing half-written).
UNDONE = (exit_codes.USER_ERROR, exit_codes.PREEMPTED, exit_codes.ENVIRONMENT)


def run(cfg: DictConfig) -> int:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torchrun = dist.torchrun_env()
    is_main = torchrun is None or torchrun["rank"] == 0  # other torchrun ranks point hydra.run.dir at "."
    lock, code = None, None
    try:
        try:
            # This process decides about the run directory, so it holds the lock, before anything there is read
            # or written; a refused run (ConfigError, exit 2) has touched nothing and removes nothing.
            lock = RunLock(run_dir) if is_main else None
            check(cfg)
            code = launch(to_container(cfg), run_dir, torchrun, config_snapshot(cfg) if is_main else None)
        except Exception as e:
            code = _failed(e, run_dir if is_main else None)
    finally:
        if lock is not None:
            undo = code is None or code in UNDONE  # None: a Ctrl-C before any worker listened, or HYDRA_FULL_ERROR
            if undo and lock.fresh:  # it made all of it
                undo = _remove_run_dir(run_dir, lock)
            lock.release(undo=undo)
    return code


def _failed(e: Exception, run_dir: Optional[Path]) -> int:
    """The exit code of a run that raised `e`, after its one line (or, for a bug, its traceback)."""
    machine = machine_error(e, run_dir)
    if machine is not None:  # a full disk, a vanished run directory: transformer/environment.py
        print(f"error: {describe(machine, run_dir)}", file=sys.stderr)
        return exit_codes.ENVIRONMENT
    if isinstance(e, USER_INPUT_ERRORS):
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise e
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    # a bug: the whole traceback, to the console and to train.log
    logging.getLogger("transformer").error("internal error; please report it with this traceback", exc_info=e)
    return exit_codes.INTERNAL


def _remove_run_dir(folder: Path, lock: RunLock) -> bool:
    """Removes a run directory whose every file this run made (it was empty when the run took its lock) unless it
    holds results (False: kept), and for a default name (outputs/<date>/<time>-<id>) the folders above it that
    are left empty; of the working directory, only run.lock. All but run.lock goes while the lock is held;
    run.lock goes with the lock, and the folder after it only while empty (a run that took the lock meanwhile
    has made run.lock again; on NFS an open file's removal leaves a .nfs file until it is closed)."""
    for handler in list(logging.getLogger().handlers):  # train.log is open in it
        if isinstance(handler, logging.FileHandler):
            logging.getLogger().removeHandler(handler)
            handler.close()
    if any((folder / f).exists() for f in ("checkpoints", "metrics.jsonl")):
        return False  # it has results: a late error never deletes them
    if folder.resolve() == Path.cwd().resolve():
        return True
    for entry in list(folder.iterdir()):
        if entry.name == lock.path.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    lock.release(undo=True)
    folders = [folder.resolve()]
    if _RUN_NAME is not None and folder.as_posix().endswith(_RUN_NAME):
        cwd = Path.cwd().resolve()  # and outputs/<date>/, then outputs/, while empty and below cwd
        folders += [parent for parent in folders[0].parents if cwd in parent.parents]
    for empty in folders:
        try:
            empty.rmdir()
        except OSError:  # holds other runs, or a new run
            break
    return True


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:  # Ctrl-C while no worker listens (a worker turns it into a stop request)
        print("error: interrupted by Ctrl-C outside training (composing the config, or closing): nothing written",
              file=sys.stderr)
        sys.exit(exit_codes.ABORTED)


def _main() -> None:
    if "--version" in sys.argv[1:]:  # before Hydra, whose own --version names only Hydra's
        print(version_line())
        return
    register_configs()
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    rank = dist.torchrun_env()
    is_main = rank is None or rank["rank"] == 0
    code = precheck(sys.argv[1:], check, writes=is_main)
    if code:
        sys.exit(code)
    if not is_main:
        # Non-zero torchrun ranks still run Hydra (to compose the same config) but must write nothing.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/hydra_logging=none"]
    _hydra_main()


if __name__ == "__main__":
    main()
