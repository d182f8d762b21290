"""One run per run directory (transformer/training/distributed/runlock.py): a refused start touches nothing, an
accepted one
undoes only what it made, and the lock holds across processes, forks and hosts."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.cli import cli_env
from tests.helpers.dist import wait_for
from transformer import exit_codes
from transformer.config import ConfigError
from transformer.training.distributed import runlock
from transformer.training.distributed.runlock import RECORD, RunLock

# A run that holds the lock and has written nothing else yet (still learning its BPE, say); "fork": it has
# forked a child (a DataLoader worker) that outlives it.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from transformer.training.distributed.runlock import RunLock
    lock = RunLock(sys.argv[1])
    if sys.argv[2] == "fork" and os.fork() == 0:
        os.write(1, f"child {os.getpid()}\\n".encode())  # one write each: the two lines never interleave
        time.sleep(600)
        os._exit(0)
    os.write(1, f"held {os.getpid()}\\n".encode())
    time.sleep(600)
""")


def hold(run: Path, fork: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), "fork" if fork else "no"], env=cli_env(),
                            stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline().split() for _ in range(2 if fork else 1)]
    assert ["held", str(proc.pid)] in lines, lines
    proc.child = next((int(pid) for word, pid in lines if word == "child"), None)
    return proc


def stop(proc: subprocess.Popen) -> None:
    for pid in (proc.child, proc.pid):
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def one_error_line(stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-4000:]
    return errors[0]


def test_a_refused_start_leaves_the_directory_of_a_run_still_preparing_its_data(tmp_path, monkeypatch, capsys):
    """The first run holds the lock on the folder Hydra just made and has written nothing else; a second start
    (transformer-train's run(), in this process) is refused, and must not take "the folder was empty" for "I
    made it" and remove it (issue 73)."""
    run = tmp_path / "run"
    run.mkdir()
    holder = hold(run)
    try:
        before = tree(run)
        code = run_cli_in_process(monkeypatch, run, fails_after_writing("checkpoints/never.pt"))  # never launched
        assert code == exit_codes.USER_ERROR
        line = one_error_line(capsys.readouterr().err)
        assert f"another run is using this run directory (pid {holder.pid} on host" in line
        assert run.is_dir() and tree(run) == before
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on host"):  # its lock is where it was
            RunLock(run)
    finally:
        stop(holder)


def test_a_second_process_is_refused_naming_the_holder_and_touches_nothing(tmp_path):
    holder = hold(tmp_path)
    try:
        before = tree(tmp_path)
        with pytest.raises(ConfigError) as refused:
            RunLock(tmp_path)
        assert (f"hydra.run.dir={tmp_path}: another run is using this run directory (pid {holder.pid} on host "
                f"{socket.gethostname()}, started ") in str(refused.value)
        assert "s ago); wait for it to end or stop it, or choose another hydra.run.dir" in str(refused.value)
        assert tree(tmp_path) == before
    finally:
        stop(holder)


def test_a_killed_holder_whose_forked_child_lingers_frees_the_directory_at_once(tmp_path):
    """A DataLoader worker forked by rank 0 outlives it for a while (kill -9, OOM): it must not keep the lock,
    or the rerun (a torchrun restart) is refused naming a dead pid, with exit 2, which nothing retries."""
    holder = hold(tmp_path, fork=True)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        os.kill(holder.child, 0)  # still there
        RunLock(tmp_path).release()
    finally:
        stop(holder)


def test_this_process_cannot_take_its_own_lock_twice(tmp_path):
    """POSIX locks do not conflict within a process, and closing the second descriptor would drop the first."""
    lock = RunLock(tmp_path)
    try:
        with pytest.raises(ConfigError, match="this process already runs in this run directory"):
            RunLock(tmp_path)
        probe = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=cli_env(), capture_output=True,
                               text=True, timeout=120)
        assert f"another run is using this run directory (pid {os.getpid()} on host" in probe.stdout, probe.stderr
    finally:
        lock.release()


PROBE = textwrap.dedent("""
    import sys
    from transformer.training.distributed.runlock import RunLock
    try:
        RunLock(sys.argv[1])
    except Exception as e:
        print(e)
""")


# ---- another host ----------------------------------------------------------------------------------------
def other_host(run: Path, age: float, job=None, **extra) -> bytes:
    """The record of a run on node-b whose last heartbeat was `age` seconds ago."""
    data = (json.dumps({"pid": 4242, "host": "node-b", "job": job, "started": "2026-12-02 08:00:00", **extra})
            + "\n").encode()
    (run / RECORD).write_bytes(data)
    then = time.time() - age
    os.utime(run / RECORD, (then, then))
    return data


def test_a_fresh_record_from_another_host_refuses_the_start_even_with_the_lock_granted(tmp_path, monkeypatch):
    """File systems whose locks are local to a node grant the lock to a second node: the record decides."""
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    data = other_host(tmp_path, age=30, job="77")
    mtime = (tmp_path / RECORD).stat().st_mtime_ns
    with pytest.raises(ConfigError) as refused:
        RunLock(tmp_path)
    assert re.search(r"another run is using this run directory \(pid 4242 on host node-b, Slurm job 77, started "
                     r"2026-12-02 08:00:00, heartbeat 3\d s ago; if that host is down, the directory is taken over "
                     rf"once the heartbeat is {runlock.STALE_S:.0f} s old\); wait for it to end or stop it",
                     str(refused.value)), refused.value
    assert (tmp_path / RECORD).read_bytes() == data and (tmp_path / RECORD).stat().st_mtime_ns == mtime


def test_a_stale_record_from_another_host_is_taken_over_with_a_warning(tmp_path, capsys):
    other_host(tmp_path, age=runlock.STALE_S + 60)
    RunLock(tmp_path).release()
    took_over = (r"taking over from pid 4242 on host node-b, started 2026-12-02 08:00:00, heartbeat \d+ s ago: no "
                 rf"heartbeat for more than {runlock.STALE_S:.0f} s, so that run is gone")
    assert re.fullmatch(rf"warning: hydra.run.dir={re.escape(str(tmp_path))}: {took_over}\n", capsys.readouterr().err)
    rec = json.loads((tmp_path / RECORD).read_text())
    assert (rec["pid"], rec["host"]) == (os.getpid(), socket.gethostname())
    assert re.fullmatch(took_over[len("taking over from "):], rec["took_over"])


def test_the_same_slurm_job_requeued_takes_over_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    other_host(tmp_path, age=5, job="77")
    RunLock(tmp_path).release()
    err = capsys.readouterr().err
    assert "warning: " in err and "taking over from pid 4242 on host node-b, Slurm job 77" in err
    assert "the same Slurm job, requeued" in err


def test_a_run_that_ended_on_another_host_leaves_the_directory_free_at_once(tmp_path, monkeypatch, capsys):
    RunLock(tmp_path).release()
    assert json.loads((tmp_path / RECORD).read_text())["ended"]
    monkeypatch.setattr(runlock.socket, "gethostname", lambda: "node-c")
    RunLock(tmp_path).release()
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / RECORD).read_text())["host"] == "node-c"


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.01)
    lock = RunLock(tmp_path)
    try:
        os.utime(tmp_path / RECORD, (1.0, 1.0))  # by path: the holder never opens run.lock a second time
        wait_for(lambda: (tmp_path / RECORD).stat().st_mtime > 1.0, 60, "a heartbeat")
    finally:
        lock.release()


# ---- undo ------------------------------------------------------------------------------------------------
def test_undo_puts_an_earlier_record_back_byte_for_byte(tmp_path):
    data = other_host(tmp_path, age=runlock.STALE_S + 60, ended="2026-12-02 09:00:00")
    st = (tmp_path / RECORD).stat()
    (tmp_path / "checkpoints").mkdir()
    lock = RunLock(tmp_path)
    assert not lock.fresh
    lock.release(undo=True)
    assert (tmp_path / RECORD).read_bytes() == data
    assert (tmp_path / RECORD).stat().st_mtime_ns == st.st_mtime_ns


def test_undo_removes_the_record_this_run_made(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.fresh
    lock.release(undo=True)
    assert list(tmp_path.iterdir()) == []


# ---- spawned workers -------------------------------------------------------------------------------------
ORPHAN = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from transformer.training.distributed.runlock import end_with_parent

    def worker(follow):
        if follow:
            end_with_parent()
        print(os.getpid(), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        multiprocessing.get_context("spawn").Process(target=worker, args=(sys.argv[1] == "follow",)).start()
        time.sleep(600)
""")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_spawned_worker_ends_with_the_parent_that_holds_the_lock(tmp_path):
    """Under the trainer's spawn the parent holds the lock; a worker outliving it (torch's SIGINT makes it save a
    last checkpoint) would write into a directory a rerun may hold by then."""
    (tmp_path / "orphan.py").write_text(ORPHAN)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "orphan.py"), "follow"], env=cli_env(),
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        parent.kill()
        parent.wait()
        wait_for(lambda: gone(child), 60, "the worker to end with its parent")
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


# ---- who removes what (transformer/cli/train.py run()) ---------------------------------------------------
def run_cli_in_process(monkeypatch, run: Path, launch) -> int:
    """`run(cfg)` of transformer-train, with Hydra's run directory `run` and `launch` standing in for training."""
    from tests.helpers.cli import compose_cfg
    from tests.helpers.dist import TINY
    from transformer.cli import train as train_cli

    hydra = SimpleNamespace(runtime=SimpleNamespace(output_dir=str(run)))
    monkeypatch.setattr(train_cli.HydraConfig, "get", lambda: hydra)
    monkeypatch.setattr(train_cli, "config_snapshot", lambda cfg: {})
    monkeypatch.setattr(train_cli, "launch", lambda cfg, run_dir, *a: launch(run_dir))
    return train_cli.run(compose_cfg(*TINY, "trainer.max_steps=2"))


def fails_after_writing(*names: str):
    def launch(run_dir: Path) -> int:
        for name in names:
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text("x")
        return exit_codes.USER_ERROR
    return launch


def test_a_run_that_made_its_folder_removes_it_when_it_fails_to_start(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()  # as Hydra makes it
    assert run_cli_in_process(monkeypatch, run, fails_after_writing("train.log", ".hydra/config.yaml")) == 2
    assert not run.exists()


def test_a_run_keeps_results_and_marks_its_record_ended(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    assert run_cli_in_process(monkeypatch, run, fails_after_writing("checkpoints/step_00000001.pt")) == 2
    assert json.loads((run / RECORD).read_text())["ended"]
    assert (run / "checkpoints" / "step_00000001.pt").is_file()


def test_a_run_in_a_folder_it_did_not_make_removes_only_its_record(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    assert run_cli_in_process(monkeypatch, run, fails_after_writing()) == 2
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
