"""Configs composed once a process and handed out as copies, and tests/training/loop/test_trainer.py's copy-task
trainer built
from them: Hydra's composition is most of a small trainer's construction, and some tests build a dozen."""
import copy
import functools

import torch

from tests.helpers.cli import compose_cfg


@functools.cache
def _composed(overrides: tuple):
    return compose_cfg(*overrides)


def composed(*overrides: str):
    """compose_cfg(*overrides), composed once a process: a copy, which the caller may change."""
    return copy.deepcopy(_composed(overrides))


def small_trainer(tmp_path, *overrides: str, seed_model: int = 0):
    """tests/training/loop/test_trainer.py's make_trainer (the small copy task, weights from `seed_model`), its
    config from composed()."""
    from tests.training.loop.test_trainer import SMALL
    from transformer.data.copy import CopyData
    from transformer.dist import DistEnv
    from transformer.tasks import build_task
    from transformer.training.distributed.parallelize import build_model, parallelize
    from transformer.training.loop.trainer import Trainer

    cfg = composed(*SMALL, *overrides)
    data = CopyData(cfg, cfg.seed, 0, 1)
    torch.manual_seed(seed_model)
    model = build_model(cfg, data)
    return Trainer(cfg, DistEnv(), parallelize(model, cfg, DistEnv()), data, build_task(cfg), tmp_path)
