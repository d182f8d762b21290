"""Faults of real runs end clearly: Ctrl-C checkpoints (a second one aborts at once), and a second run on a live
run directory is refused with one line naming the holder, leaving the directory as it was."""
import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.cli import cli_env, train_cmd
from tests.helpers.dist import (
    TINY,
    finish,
    last_ckpt,
    popen,
    spawned_workers,
    step_files,
    torchrun,
    torchrun_cmd,
    train,
    wait_for,
)
from transformer import exit_codes
from transformer.training import launcher
from transformer.training.components.checkpoint import load_checkpoint

LONG = ("trainer.max_steps=100000", "checkpoint.every_steps=30")


def one_error_line(stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-4000:]
    return errors[0]


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def every_checkpoint_loads(run: Path) -> None:
    for p in (run / "checkpoints").glob("*.pt"):
        load_checkpoint(p)
    assert not list((run / "checkpoints").glob(".*.tmp"))


# ---- Ctrl-C ----------------------------------------------------------------------------------------------
def test_second_ctrl_c_aborts_and_a_repeated_first_one_does_not(monkeypatch):
    """One keypress reaches a worker twice (directly and through its launcher) within SAME_CTRL_C_S: one stop.
    A later SIGINT is the second keypress: os._exit(130)."""
    now = [100.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: now[0])
    exits = []
    monkeypatch.setattr(launcher.os, "_exit", lambda code: exits.append(code))
    stop = launcher.StopRequest()
    try:
        stop._on_signal(signal.SIGINT, None)
        assert stop.signum == signal.SIGINT and not exits
        now[0] += 0.1
        stop._on_signal(signal.SIGTERM, None)  # the spawn parent's forwarded copy
        stop._on_signal(signal.SIGINT, None)  # torchrun's forwarded copy
        assert not exits
        now[0] += launcher.SAME_CTRL_C_S + 0.5
        stop._on_signal(signal.SIGTERM, None)  # a repeated SIGTERM still only asks for the stop
        assert not exits
        stop._on_signal(signal.SIGINT, None)
        assert exits == [exit_codes.ABORTED]
    finally:
        stop.close()


def test_a_second_ctrl_c_mid_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The abort skips every `finally` (os._exit) and may interrupt a checkpoint being written: what the folder
    holds when the process ends has no temporary file of that write, nor of an atomic_link."""
    from transformer.atomic import atomic_open
    from transformer.training.components.checkpoint import atomic_link

    class Exited(BaseException):
        pass

    at_exit = []

    def exit_now(code):  # os._exit: nothing after it runs, so the folder is judged here
        at_exit.append((code, sorted(p.name for p in tmp_path.iterdir())))
        raise Exited

    monkeypatch.setattr(launcher.os, "_exit", exit_now)
    (tmp_path / "step_00000001.pt").write_bytes(b"")
    with pytest.raises(Exited), atomic_open(tmp_path / "step_00000002.pt") as f:
        f.write(b"half a checkpoint")
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        launcher.abort()  # what the handler of a second Ctrl-C calls, here in mid-write

    def abort_before_rename(src, dst):  # the abort lands between the link and its rename
        launcher.abort()
    monkeypatch.setattr("transformer.training.components.checkpoint.os.replace", abort_before_rename)
    with pytest.raises(Exited):
        atomic_link(tmp_path / "step_00000001.pt", tmp_path / "last.pt")
    assert at_exit == [(exit_codes.ABORTED, ["step_00000001.pt"])] * 2


def test_ctrl_c_checkpoints_exits_3_and_resumes(tmp_path):
    run = tmp_path / "run"
    proc = popen(train_cmd(*TINY, f"hydra.run.dir={run}", *LONG), tmp_path)
    wait_for(lambda: step_files(run), 180, "the first checkpoint", proc)
    proc.send_signal(signal.SIGINT)
    err = finish(proc)
    assert proc.returncode == exit_codes.PREEMPTED, err[-4000:]
    stopped = last_ckpt(run)["trainer"]["step"]
    assert "received SIGINT" in err and "Ctrl-C again" in err and "KeyboardInterrupt" not in err
    assert f"stopped by a signal at step {stopped}" in err and f"hydra.run.dir={run} to resume" in err
    every_checkpoint_loads(run)
    res = train(run, f"trainer.max_steps={stopped + 2}", cwd=tmp_path)
    assert f"at step {stopped}" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("spawn", [False, True], ids=["one_worker", "spawn_parent"])
def test_second_ctrl_c_exits_130_without_writing(tmp_path, spawn):
    """Steps slow enough (a wider model, long sequences) that the stop, read a step late, is still pending when
    the second Ctrl-C comes: the run ends at once with 130, without the stop's checkpoint."""
    run = tmp_path / "run"
    wide = ("model.d_model=256", "model.d_ff=1024", "model.N=2", "data.copy.seq_len=60", "data.max_tokens=6000",
            "checkpoint.every_steps=1")
    extra = ("trainer.devices=2", "trainer.accelerator=cpu") if spawn else ()
    proc = popen(train_cmd(*TINY, f"hydra.run.dir={run}", "trainer.max_steps=100000", *wide, *extra), tmp_path)
    wait_for(lambda: step_files(run), 240, "the first checkpoint", proc)
    if spawn:
        assert len(spawned_workers(proc.pid)) == 2
    proc.send_signal(signal.SIGINT)
    time.sleep(launcher.SAME_CTRL_C_S + 0.2)
    proc.send_signal(signal.SIGINT)
    err = finish(proc)
    assert proc.returncode == exit_codes.ABORTED, err[-4000:]
    assert "aborted by a second Ctrl-C" in err and "Traceback" not in err and "stopped by a signal" not in err
    every_checkpoint_loads(run)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("launcher_kind", ["spawn", "torchrun"])
def test_ctrl_c_to_the_launcher_checkpoints_on_every_worker(tmp_path, launcher_kind):
    """The spawn parent passes a first SIGINT on as SIGTERM, torchrun's agent as SIGINT: either way the two
    workers stop at the same step with a checkpoint (exit 3), and the same command resumes."""
    run = tmp_path / "run"
    cpu2 = ("trainer.accelerator=cpu",)
    if launcher_kind == "spawn":
        cmd = train_cmd(*TINY, f"hydra.run.dir={run}", *LONG, "trainer.devices=2", *cpu2)
    else:
        cmd = torchrun_cmd(*TINY, f"hydra.run.dir={run}", *LONG, *cpu2, rdzv_id="sigint")
    proc = popen(cmd, tmp_path)
    wait_for(lambda: step_files(run), 180, "the first checkpoint", proc)
    proc.send_signal(signal.SIGINT)
    err = finish(proc)
    stopped = last_ckpt(run)["trainer"]["step"]
    assert f"stopped by a signal at step {stopped}" in err and "aborted" not in err, err[-4000:]
    if launcher_kind == "spawn":
        assert proc.returncode == exit_codes.PREEMPTED, err[-4000:]
    every_checkpoint_loads(run)
    more = f"trainer.max_steps={stopped + 2}"
    if launcher_kind == "spawn":
        res = train(run, more, "trainer.devices=2", *cpu2, cwd=tmp_path)
    else:
        res = torchrun(run, more, *cpu2, cwd=tmp_path, rdzv_id="sigint")
    assert f"at step {stopped}" in res.stderr


# ---- one run per directory -------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    from transformer.training.distributed.runlock import RECORD, RunLock
    if sys.argv[2] == "record":
        lock = RunLock(sys.argv[1])
    else:  # locked, its record not written yet: the refused run asks /proc/locks
        fd = os.open(os.path.join(sys.argv[1], RECORD), os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(600)
""")


def hold(run: Path, record: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), "record" if record else "no"], env=cli_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_on_a_live_directory_is_refused_and_writes_nothing(tmp_path):
    """Refused whether the live run has written its record or is still starting (locked, no record yet: the
    refused run asks /proc/locks); once the holder dies uncleanly the same command resumes. The runs go in this
    process (transformer-train's main(), exit code and output as a process's; the lock is another process's)."""
    from tests.helpers.inprocess import call_main
    from transformer.cli import train as train_cli

    run = tmp_path / "run"

    def run_train(steps: int) -> subprocess.CompletedProcess:
        return call_main(train_cli.main, [*TINY, f"hydra.run.dir={run}", f"trainer.max_steps={steps}"], tmp_path,
                         prog="transformer-train")

    assert run_train(2).returncode == 0
    stale = {"pid": 999999999, "host": socket.gethostname(), "started": "x"}  # a dead process's record
    for record in (True, False):
        (run / "run.lock").write_text(json.dumps(stale))
        holder = hold(run, record)
        try:
            before = tree(tmp_path)
            res = run_train(4)
            assert res.returncode == exit_codes.USER_ERROR, res.stderr[-3000:]
            line = one_error_line(res.stderr)
            assert f"hydra.run.dir={run}: another run is using this run directory (pid {holder.pid} on host" in line
            assert tree(tmp_path) == before
        finally:
            holder.kill()
            holder.wait()
    # The holder died without cleaning up (SIGKILL): the same command now resumes.
    res = run_train(4)
    assert res.returncode == 0 and "resumed from" in res.stderr and last_ckpt(run)["trainer"]["step"] == 4
    assert '"pid": ' in (run / "run.lock").read_text()


def test_a_torchrun_rank_other_than_0_takes_no_lock(tmp_path, monkeypatch):
    """Only the rank that owns the run directory locks it (the other ranks point hydra.run.dir at ".")."""
    from types import SimpleNamespace

    from tests.helpers.cli import compose_cfg
    from transformer.cli import train as train_cli

    taken = []
    hydra = SimpleNamespace(runtime=SimpleNamespace(output_dir=str(tmp_path)))
    monkeypatch.setattr(train_cli.HydraConfig, "get", lambda: hydra)
    monkeypatch.setattr(train_cli, "RunLock", lambda d: taken.append(d))
    monkeypatch.setattr(train_cli, "config_snapshot", lambda cfg: {})
    monkeypatch.setattr(train_cli, "launch", lambda *a: 0)
    cfg = compose_cfg(*TINY, "trainer.max_steps=2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert train_cli.run(cfg) == 0 and taken == ([] if rank == "1" else [tmp_path])
