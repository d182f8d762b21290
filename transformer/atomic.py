"""Atomic file writes: a temporary file in the target's folder, fsynced, then renamed over the target.

A reader, or a crash at any moment, sees the old file or the complete new one, never a partial one.
`tempfile.mkstemp` creates its file with mode 0600; the finished file gets the mode a plain `open()`
would give (0666 minus the umask), and a folder built beside its target (`temp_dir_beside`) that of a plain
mkdir, so a teammate, or a container running as another user, can read the checkpoints, downloads, exports
and outputs of a run.
"""
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from transformer.environment import injected_fault


def _umask() -> int:
    # /proc avoids os.umask's set-and-restore, which would race with threads creating files meanwhile.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Temporary files of this process's writes in progress. An exit that runs no `finally` (a second Ctrl-C's
# os._exit, from a signal handler that may interrupt a checkpoint mid-write) removes them with remove_pending().
_PENDING: set = set()


@contextlib.contextmanager
def pending(tmp) -> Iterator[None]:
    """Marks `tmp` as a write in progress for the duration of the block."""
    _PENDING.add(str(tmp))
    try:
        yield
    finally:
        _PENDING.discard(str(tmp))


def remove_pending() -> None:
    """Deletes the temporary files of the writes in progress (for an exit that skips their cleanup)."""
    for tmp in list(_PENDING):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def fsync_dir(folder) -> None:
    """Makes a rename in `folder` durable. Some file systems cannot fsync a folder: skipped there."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path, mode: str = "wb", suffix: str = ".tmp", encoding: str | None = None) -> Iterator[IO]:
    """`with atomic_open(path) as f: ...` writes `path` only if the block completes; an exception
    inside it (a failed checksum, say) leaves `path` untouched and no temporary file behind."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    except OSError as e:
        e.filename = str(path)  # not the temporary name: the file the caller asked for
        raise
    try:
        with pending(tmp):
            with contextlib.suppress(OSError):  # a file system without Unix modes keeps its own
                os.fchmod(fd, 0o666 & ~_umask())
            with os.fdopen(fd, mode, encoding=encoding) as f:
                yield f
                injected_fault(path)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            e.filename = str(path)  # a failed write or flush names no file: name the one being written
        raise
    fsync_dir(path.parent)


def temp_dir_beside(out) -> Path:
    """A new, empty folder beside `out`, to be filled and then renamed to `out`. It gets the mode a plain
    mkdir gives (0777 minus the umask), not `tempfile.mkdtemp`'s 0700, which the rename would keep: another
    user, or a container running as another uid, could not read the finished folder."""
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.absolute().parent))
    with contextlib.suppress(OSError):  # a file system without Unix modes keeps its own
        os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def write_text_atomic(path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
