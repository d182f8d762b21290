"""Atomic writes: all or nothing, and the finished file has the mode a plain open() would give."""
import errno
import os
import stat

import pytest
import torch

from transformer.atomic import atomic_open, temp_dir_beside, write_text_atomic
from transformer.training.components.checkpoint import atomic_link, atomic_save


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


@pytest.mark.parametrize("mask, mode", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_a_folder_built_beside_its_target_gets_the_umasks_mode_not_mkdtemps_0700(tmp_path, restore_umask, mask, mode):
    """Exports are built in it and renamed into place, keeping its mode: 0700 would lock out a teammate."""
    os.umask(mask)
    tmp = temp_dir_beside(tmp_path / "export")
    assert tmp.parent == tmp_path and tmp.name.startswith(".export.") and not any(tmp.iterdir())
    assert stat.S_IMODE(tmp.stat().st_mode) == mode


def test_the_copy_of_last_pt_on_a_file_system_without_hard_links_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    src, dst = tmp_path / "step_00000001.pt", tmp_path / "last.pt"
    src.write_bytes(b"state" * 1000)
    events = []

    def no_link(a, b):
        raise OSError(errno.EPERM, "Operation not permitted")

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a)))
        real_replace(a, b)

    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_link(src, dst)
    assert dst.read_bytes() == src.read_bytes() and not dst.samefile(src)  # a copy
    tmp = str(tmp_path / ".last.pt.link.tmp")
    assert ("fsync", tmp) in events and events.index(("fsync", tmp)) < events.index(("replace", tmp)), events
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step_00000001.pt"]
