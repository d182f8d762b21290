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
from transformer.config import CONF_DIR, ConfigError, register_configs, to_container, validate
from transformer.environment import describe, machine_error
from transformer.tasks import build_task
from transformer.training import fp8
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


def run(cfg: DictConfig) -> int:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    torchrun = dist.torchrun_env()
    is_main = torchrun is None or torchrun["rank"] == 0
    # Hydra has just made the run directory (other torchrun ranks point it at "."). If it was empty, this run
    # owns it: a run refused for bad input removes it again, so a failed start leaves nothing half-written.
    owned = is_main and run_dir.is_dir() and not any(run_dir.iterdir())
    try:
        check(cfg)
        code = launch(to_container(cfg), run_dir, torchrun, config_snapshot(cfg) if is_main else None)
    except Exception as e:
        code = _failed(e, run_dir if is_main else None)
    if code in (exit_codes.USER_ERROR, exit_codes.PREEMPTED, exit_codes.ENVIRONMENT) and owned:
        _remove_run_dir(run_dir)  # only while it holds no checkpoint and no metrics
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
