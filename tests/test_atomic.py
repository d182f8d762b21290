"""Atomic writes: all or nothing, and the finished file has the mode a plain open() would give."""
import os
import stat

import pytest
import torch

from transformer.atomic import atomic_open, write_text_atomic
from transformer.training.checkpoint import atomic_save


@pytest.fixture
def restore_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_files_get_the_mode_of_the_umask_not_mkstemps_0600(tmp_path, restore_umask, mask, mode):
    os.umask(mask)
    write_text_atomic(tmp_path / "a.txt", "x")
    atomic_save({"w": torch.zeros(2)}, tmp_path / "c.pt")  # checkpoints: teammates must be able to read them
    for name in ("a.txt", "c.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_a_failed_block_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(path, "w", encoding="utf-8") as f:
            f.write("half of the new")
            raise RuntimeError("checksum mismatch")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_complete_block_replaces_the_file(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with atomic_open(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
