"""One run per run directory: global rank 0 holds an exclusive flock on the run directory itself for the run's
life. The kernel drops it when the process ends, however it ends, so a crashed run leaves no lock to clean up
and its rerun resumes at once; a second run started on a live directory is refused (exit code 2) before it
writes anything there.

The lock is taken on the folder, not on a file in it, so taking it (or being refused) writes nothing. Once the
run is accepted, `record_holder` writes `run.lock` (pid, host, start time): a refused run names the holder
from it, or from /proc/locks while the holder is still starting up.
"""
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from transformer.atomic import write_text_atomic
from transformer.config import ConfigError

log = logging.getLogger(__name__)
RECORD = "run.lock"


class RunLock:
    """`RunLock(run_dir)` takes the lock or raises ConfigError naming the holder; `release()` (or the end of
    the process) frees it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: Optional[int] = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(self.run_dir, self.fd)
            self.release()
            raise ConfigError(f"hydra.run.dir={self.run_dir}: another run is using this run directory ({holder}); "
                              "wait for it to end or stop it, or choose another hydra.run.dir") from None
        except OSError as e:  # a file system without flock (some network mounts): run unguarded, as before
            log.warning("%s: cannot lock the run directory (%s); nothing stops a second run from using it",
                        self.run_dir, e.strerror)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def record_holder(run_dir: Path) -> None:
    """Who holds the lock, for the message of a refused run (written once the run is accepted)."""
    write_text_atomic(Path(run_dir) / RECORD, json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


def describe_holder(run_dir: Path, fd: int) -> str:
    """`pid 123 on host h, started ...` from the holder's record; the record of a dead process on this host is
    stale (the holder has not written its own yet): then the flock's owner from /proc/locks."""
    try:
        rec = json.loads((Path(run_dir) / RECORD).read_text())
        pid, host = int(rec["pid"]), str(rec["host"])
    except (OSError, ValueError, KeyError, TypeError):
        rec = None
    if rec is not None and (host != socket.gethostname() or _alive(pid)):
        return f"pid {pid} on host {host}, started {rec.get('started', '?')}"
    pid = _flock_owner(fd)
    return f"pid {pid} on host {socket.gethostname()}" if pid else "a process that holds its lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _flock_owner(fd: int) -> Optional[int]:
    """The pid /proc/locks gives for the flock on the file behind `fd` (Linux; None elsewhere)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "FLOCK" in parts and ident in parts:
            pid = parts[parts.index(ident) - 1]
            if pid.isdigit():
                return int(pid)
    return None
