"""Failures of the machine, not of the program or its input: a full disk (or quota), a read-only or failing file
system, a run directory that vanished or lost its permissions mid-run. They end with one `error:` line naming
the path, the free space there and the last checkpoint, and exit code 5 (exit_codes.ENVIRONMENT): the same
command resumes once the cause is fixed. Writes are atomic (transformer/atomic.py), so no half-written file
is left and every checkpoint on disk loads.
"""
import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Optional

from transformer.checkpoint_files import FOLDER, step_files

# Always the machine's: whatever the path.
MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE}
# The machine's when they hit a path inside the run directory, which this run created or accepted (it vanished,
# or its permissions changed under the run); elsewhere they stay bad input (a missing data file, say).
RUN_DIR_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR}
# Tests: writes through atomic_open to a file whose name ends with this fail as on a full disk, mid-write.
FAULT_ENV = "TRANSFORMER_TEST_ENOSPC"


def machine_error(e: BaseException, run_dir: Optional[Path] = None) -> Optional[OSError]:
    """The OSError in `e`'s chain (itself, its cause or context) that is the machine's fault, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            if e.errno in MACHINE_ERRNOS:
                return e
            if e.errno in RUN_DIR_ERRNOS and run_dir is not None and e.filename and _inside(e.filename, run_dir):
                return e
        e = e.__cause__ or e.__context__
    return None


def _inside(path, folder) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    except (TypeError, ValueError):
        return False


def free_space(path) -> str:
    """`1.2 GB free of 20 GB` on the file system holding `path` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def last_checkpoint(run_dir: Optional[Path]) -> str:
    if run_dir is None:
        return "none"
    try:
        files = step_files(Path(run_dir) / FOLDER)
    except OSError:
        return f"unknown ({run_dir} cannot be read)"
    return str(files[0][1]) if files else "none"


def describe(err: OSError, run_dir: Optional[Path], where: Optional[Path] = None) -> str:
    """The one line: what failed where, the free space there, the last checkpoint, what to do. `where`: the
    folder being written, for an error that names no file."""
    path = os.fsdecode(err.filename) if err.filename else where or run_dir
    what = os.strerror(err.errno) if err.errno else str(err)
    line = f"cannot write {path or 'a file'}: {what} ({free_space(path) if path else 'free space unknown'})"
    if run_dir is not None:
        line += (f"; last checkpoint: {last_checkpoint(run_dir)}; not a bug: once there is space (or the run "
                 f"directory is back and writable) rerun the same command to resume")
    return line


def quiet_thread_faults() -> None:
    """A writer thread (TensorBoard's) that fails on a full or read-only disk prints no traceback: the main thread
    meets the same error at its next write and reports it in one line. Other exceptions print as before."""
    if getattr(threading.excepthook, "quiet_faults", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if args.exc_value is None or machine_error(args.exc_value) is None:
            previous(args)

    hook.quiet_faults = True
    threading.excepthook = hook


def injected_fault(path) -> None:
    """The test hook of FAULT_ENV (see there)."""
    suffix = os.environ.get(FAULT_ENV)
    if suffix and str(path).endswith(suffix):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
