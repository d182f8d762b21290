"""One run per run directory. The process that decides about the run directory (the single worker, torchrun's
global rank 0, or the parent of spawned workers) holds `RUN/run.lock` for the run's life:

- a POSIX record lock (`fcntl.lockf`) on the file, which NFS forwards to its server, so it holds across hosts
  there. It belongs to the process: the kernel drops it when the process ends, however it ends, and forked
  children (DataLoader workers outliving a killed rank 0) do not inherit it;
- a record in the file: pid, host, Slurm job id, start time. Its modification time is the heartbeat, refreshed
  every HEARTBEAT_S by a thread of the holder, and a clean release marks the record ended.

Taking the lock refuses the start (ConfigError, exit code 2) while another run holds it, naming that run; the
record refuses it too when it comes from another host and its heartbeat is fresh, even where the file system
granted the lock (file systems whose locks are local to a node). A record from another host is taken over, with
a warning, once its heartbeat is older than STALE_S, or at once if it names this Slurm job (requeued). On this
host the lock decides alone: a crashed run's rerun resumes at once.

A POSIX lock is dropped when its process closes any descriptor of the file: the holding process never opens
run.lock a second time (the record is read and written through the lock's own descriptor).
"""
import ctypes
import errno
import fcntl
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from transformer import exit_codes
from transformer.config import ConfigError

RECORD = "run.lock"
HEARTBEAT_S = 5.0
# A holder's heartbeat may stall for a while without its run being gone: a hard NFS mount retries a stalled
# server for 60 s (timeo=600) before it even reports it, and a swapping node or a long GIL-holding call delays
# the thread. 120 s is beyond those and the clock skew of NTP-synced nodes, and still short for whoever
# resubmits a job after its node died (a requeued job with the same id does not wait at all).
STALE_S = 120.0
PR_SET_PDEATHSIG = 1  # prctl(2)
_HELD: Dict[Tuple[int, int], "RunLock"] = {}  # (st_dev, st_ino) of the lock files this process holds


class RunLock:
    """`RunLock(run_dir)` takes the lock or raises ConfigError naming the holder; `release()` frees it (the end
    of the process does too). `fresh`: the folder held nothing else when the lock was taken, so everything in
    it is this run's."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RECORD
        self.fd: Optional[int] = None
        self.fresh = False
        self._mutex = threading.Lock()  # the heartbeat never touches a closed (or reused) descriptor
        self._stop = threading.Event()
        self._old: Optional[Tuple[bytes, int, int]] = None  # run.lock before: release(undo=True) puts it back
        self._record = {"pid": os.getpid(), "host": socket.gethostname(), "job": os.environ.get("SLURM_JOB_ID"),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._take()
        try:
            self._old = self._read()
            self.fresh = not self._old[0] and not set(os.listdir(self.run_dir)) - {RECORD}
            self._write(self._record)
        except BaseException:
            self.release(undo=True)
            raise
        threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True).start()

    def _take(self) -> None:
        for _ in range(10):
            if _key(self.path) in _HELD:  # opening it again would drop the lock this process holds
                raise ConfigError(f"hydra.run.dir={self.run_dir}: this process already runs in this run directory")
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                granted = _lock(self.fd, self.path)
                # A holder that undid its start removed run.lock (or its folder) after we opened it: again.
                replaced = granted and _key(self.path) != _key(self.fd)
                if not replaced:
                    self._check(granted)
                    _HELD[_key(self.fd)] = self
                    return
            except BaseException:
                replaced = True
                raise
            finally:
                if replaced:
                    os.close(self.fd)
                    self.fd = None
        raise ConfigError(f"hydra.run.dir={self.run_dir}: {RECORD} keeps being replaced; is another run starting?")

    def _check(self, granted: Optional[bool]) -> None:
        """Refuses the start unless the lock was granted (None: the file system has no locks) and the record
        allows it; takes over a stale record from another host with a warning."""
        data, _, mtime_ns = self._read()
        rec = _parse(data)
        age = max(0.0, time.time() - mtime_ns / 1e9)
        here = socket.gethostname()
        if granted is False:
            if not _live(rec, here):  # not written yet, or an earlier run's
                raise refused(self.run_dir, _local_holder(self.fd), None, here)
            raise refused(self.run_dir, describe(rec, age), rec, here)
        if rec is None or rec.get("ended") or (rec["host"] == here and (granted or not _live(rec, here, age))):
            return  # no holder, or (on this host) a dead one: a crashed run resumes at once
        job = os.environ.get("SLURM_JOB_ID")
        if rec["host"] != here and rec.get("job") and str(rec["job"]) == job:
            why = "the same Slurm job, requeued"
        elif age > STALE_S:
            why = f"no heartbeat for more than {STALE_S:.0f} s, so that run is gone"
        else:
            raise refused(self.run_dir, describe(rec, age), rec, here)
        self._record["took_over"] = f"{describe(rec, age)}: {why}"  # kept in run.lock for whoever wonders later
        warn(f"hydra.run.dir={self.run_dir}: taking over from {self._record['took_over']}")

    def _read(self) -> Tuple[bytes, int, int]:
        """run.lock's bytes, atime and mtime (ns), through the lock's descriptor."""
        st = os.fstat(self.fd)
        return os.pread(self.fd, max(st.st_size, 1), 0), st.st_atime_ns, st.st_mtime_ns

    def _write(self, rec) -> None:
        data = rec if isinstance(rec, bytes) else (json.dumps(rec) + "\n").encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)  # visible to other hosts now, not when the client flushes

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._mutex:
                if self.fd is None:
                    return
                try:
                    os.utime(self.fd)  # now, by the file server's clock on NFS
                except OSError:  # a file-server hiccup: the next beat tries again
                    pass

    def release(self, undo: bool = False) -> None:
        """Frees the lock. The record is marked ended, so another host may start at once; `undo` (a run that
        failed before it had anything to keep) puts run.lock back as it was instead."""
        self._stop.set()
        with self._mutex:
            if self.fd is None:
                return
            try:
                if not undo:
                    self._write({**self._record, "ended": time.strftime("%Y-%m-%d %H:%M:%S")})
                elif self._old is None:  # unread: left as it is
                    pass
                elif not self._old[0]:  # this run made it
                    if _key(self.path) == _key(self.fd):
                        os.unlink(self.path)
                else:
                    self._write(self._old[0])
                    os.utime(self.fd, ns=self._old[1:])  # its heartbeat as old as it was
            except OSError:  # the folder has gone (removed by this run, or by someone): nothing to keep
                pass
            finally:
                _HELD.pop(_key(self.fd), None)
                os.close(self.fd)  # drops the lock
                self.fd = None


def warn(text: str) -> None:
    """One line on the console: the logging of this process is not set up yet (its workers set it up)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def refused(run_dir: Path, holder: str, rec: Optional[dict], here: str) -> ConfigError:
    gone = ""
    if rec is not None and rec["host"] != here:
        gone = f"; if that host is down, the directory is taken over once the heartbeat is {STALE_S:.0f} s old"
    return ConfigError(f"hydra.run.dir={run_dir}: another run is using this run directory ({holder}{gone}); wait "
                       "for it to end or stop it, or choose another hydra.run.dir")


def describe(rec: dict, age: float) -> str:
    """`pid 123 on host h, Slurm job 7, started ..., heartbeat 3 s ago`."""
    job = f", Slurm job {rec['job']}" if rec.get("job") else ""
    return f"pid {rec['pid']} on host {rec['host']}{job}, started {rec.get('started', '?')}, heartbeat {age:.0f} s ago"


def _parse(data: bytes) -> Optional[dict]:
    """The record, or None where there is none yet (or it is half-written)."""
    try:
        rec = json.loads(data.decode())
        rec["pid"], rec["host"] = int(rec["pid"]), str(rec["host"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return rec


def _live(rec: Optional[dict], here: str, age: float = 0.0) -> bool:
    """A record that may belong to a running holder (on this host: its pid is alive and beats)."""
    if rec is None or rec.get("ended"):
        return False
    return rec["host"] != here or (_alive(rec["pid"]) and age <= STALE_S)


def _lock(fd: int, path: Path) -> Optional[bool]:
    """True if granted, False if another process holds it, None where the file system has no locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        warn(f"{path}: cannot lock it ({e.strerror}); only its record (the heartbeat) guards the run directory")
        return None


def _key(target) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of a path (None if there is none) or of a descriptor."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _local_holder(fd: int) -> str:
    """The holder from /proc/locks (Linux), while its record is not written yet or is an old run's."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if "POSIX" in parts and ident in parts:
            pid = parts[parts.index(ident) - 1]
            if pid.isdigit():
                return f"pid {pid} on host {socket.gethostname()}"
    return "a process that holds its lock, on this host or another"


def end_with_parent() -> None:
    """A spawned worker ends (SIGKILL) when its parent does: the parent holds the run's lock, and torch's own
    rule (SIGINT, on which a worker saves a last checkpoint) would have it write into a directory that a rerun
    may have locked meanwhile. Linux only; elsewhere nothing happens."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before prctl: no signal will come
        os._exit(exit_codes.INTERNAL)
