"""CPU threads per worker: trainer.threads, else OMP_NUM_THREADS, else the affinity mask shared among the
node's workers."""
import os

import torch

from transformer.training.launcher import set_threads


def test_threads_follow_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    old = torch.get_num_threads()
    try:
        assert set_threads(None, 2) == 4 and torch.get_num_threads() == 4
        assert set_threads(None, 16) == 1  # more workers than cores: one thread each, never zero
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})  # e.g. taskset -c 2,3
        assert set_threads(None, 1) == 2
        assert set_threads(3, 1) == 3  # trainer.threads wins
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the launch scripts or the user
        assert set_threads(None, 1) == 1
    finally:
        torch.set_num_threads(old)
