"""Fixtures and collection hooks; the helpers themselves live in tests/helpers/."""
import os

import pytest
import torch

from tests.helpers.cli import compose_cfg
from tests.helpers.report import pytest_runtest_logreport  # noqa: F401 (a hook: TRANSFORMER_TEST_LOG)

# Under pytest-xdist (`make test` runs two workers) the cores are shared out among the workers: more torch threads
# than cores make every worker spin-wait on the others.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture
def make_cfg():
    return compose_cfg


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


@pytest.fixture(autouse=True)
def _fp32_on_every_cpu(monkeypatch):
    """trainer.precision=auto is bf16 on CPUs with AMX or AVX512-BF16 units: in-process tests run as on a CPU
    without them, so every CI machine computes the same numbers; tests of that choice patch it themselves."""
    from transformer.training.speed import speedups

    monkeypatch.setattr(speedups, "native_bf16_cpu", lambda: False)
