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


def test_keep_freed_memory_stops_page_faults_on_reuse():
    """trainer.keep_freed_memory (speedups.keep_freed_memory): a 64 MiB tensor allocated, freed and allocated
    again faults its pages in while the heap grows, then never (by default glibc serves blocks over 32 MiB
    with a fresh mmap each time). In a child process, since the setting is process-wide: first without it,
    then with it (it cannot be turned off again)."""
    import json
    import subprocess
    import sys
    code = """
import json, resource, torch
from transformer.training.speed.speedups import keep_freed_memory
def faults():
    for _ in range(10):  # warm-up: the heap grows to its size for this pattern
        torch.ones(1 << 24)  # 64 MiB of float32, freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(1 << 24)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
off = faults()
assert keep_freed_memory()
print(json.dumps({"off": off, "on": faults()}))
"""
    faults = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    pages = (64 << 20) // 4096  # 16,384 pages of 4 KiB per allocation
    assert faults["off"] > 4 * pages // 2, faults  # default glibc: every allocation faults in anew
    assert faults["on"] < pages // 4, faults
