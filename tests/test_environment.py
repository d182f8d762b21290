"""A full disk, a vanished or read-only run directory, a failing write: one `error:` line naming the path, the free
space and the last checkpoint, exit code 5 (not a bug, not bad input), no half-written file, every file left
loads, and the same command resumes once there is space. The fast tests inject the failure at the write
(TRANSFORMER_TEST_ENOSPC, mid-write); the slow one fills a real tmpfs."""
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_preprocess_cli import corpus
from tests.helpers.cli import train_cmd
from tests.helpers.dist import TINY, env_for, finish, kill_tree, popen, step_files, train, wait_for
from transformer import exit_codes
from transformer.environment import FAULT_ENV, describe, machine_error
from transformer.training.components.checkpoint import Checkpointer, load_checkpoint
from transformer.training.reporting.logs import MetricsLogger

STEPS = ("trainer.max_steps=6", "checkpoint.every_steps=2", "trainer.val_every=2")


def one_error_line(stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-4000:]
    return errors[0]


def everything_loads(run: Path) -> None:
    folder = run / "checkpoints"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], list(folder.iterdir())  # no temp file
    for p in folder.glob("*.pt"):
        load_checkpoint(p)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


@pytest.mark.parametrize("fails, last, extra", [
    ("step_00000004.pt", "step_00000002.pt", ()),  # a periodic (and validation's best) checkpoint
    ("average_last2.pt", "step_00000006.pt", ("checkpoint.average_last=2",)),  # the end-of-run average
], ids=["checkpoint", "average"])
def test_a_full_disk_is_one_line_exit_5_and_the_same_command_resumes(tmp_path, fails, last, extra, capfd):
    """The periodic checkpoint's case starts the command as processes; the average's runs its main() in this
    process, what is written to the file descriptors captured as from a process."""
    run = tmp_path / "run"
    if fails.startswith("step_"):
        def command(env=None, expect=0):
            return train(run, *STEPS, *extra, cwd=tmp_path, expect=expect, env=env)
    else:
        from tests.helpers.inprocess import call_main
        from transformer.cli import train as train_cli

        def command(env=None, expect=0):
            res = call_main(train_cli.main, [*TINY, f"hydra.run.dir={run}", *STEPS, *extra], tmp_path,
                            env=env or env_for(), prog="transformer-train", capture=capfd)
            assert res.returncode == expect, res.stderr[-6000:]
            return res
    res = command(env=env_for(**{FAULT_ENV: fails}), expect=exit_codes.ENVIRONMENT)
    line = one_error_line(res.stderr)
    assert f"cannot write {run}/checkpoints/{fails}: No space left on device (" in line and " free of " in line
    assert f"last checkpoint: {run}/checkpoints/{last}" in line and "rerun the same command" in line
    everything_loads(run)
    res = command()  # space freed
    assert (run / "checkpoints" / "best.pt").is_file()
    everything_loads(run)


@pytest.mark.distributed
def test_a_full_disk_under_two_spawned_workers_is_one_line_exit_5(tmp_path):
    """Rank 0's write fails while rank 1 waits at the barrier: the parent prints rank 0's line once."""
    run = tmp_path / "run"
    res = train(run, *STEPS, "trainer.devices=2", "trainer.accelerator=cpu", cwd=tmp_path,
                expect=exit_codes.ENVIRONMENT, env=env_for(**{FAULT_ENV: "step_00000004.pt"}))
    line = one_error_line(res.stderr)
    assert f"cannot write {run}/checkpoints/step_00000004.pt: No space left on device" in line
    everything_loads(run)


def test_a_vanished_run_directory_is_the_machines_fault(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ck = Checkpointer(run, keep_last=2)
    import shutil

    shutil.rmtree(run)
    with pytest.raises(FileNotFoundError) as e:
        ck.save({"x": 1}, 4, is_best=False)
    assert not run.exists()  # not made again: the run stops instead of writing into a new, empty directory
    err = machine_error(e.value, run)
    assert err is not None and str(run) in describe(err, run)
    assert machine_error(FileNotFoundError(errno.ENOENT, "gone", "/elsewhere/data.de"), run) is None  # bad input
    ro = OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert machine_error(RuntimeError("wrapped"), run) is None
    try:
        raise RuntimeError("torch's message") from ro
    except RuntimeError as chained:
        assert machine_error(chained, run) is ro


def test_a_failed_metrics_write_names_metrics_jsonl(tmp_path, monkeypatch):
    logger = MetricsLogger(tmp_path)
    logger.log("valid", 1, 0, val_loss=1.0)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(logger, "file", type("Full", (), {"write": full, "name": str(tmp_path / "metrics.jsonl")})())
    with pytest.raises(OSError) as e:
        logger.log("valid", 2, 0, val_loss=1.0)
    logger.file = None
    logger.close()
    assert describe(machine_error(e.value), None).startswith(f"cannot write {tmp_path / 'metrics.jsonl'}: No space")


def test_preprocessing_onto_a_full_disk_is_one_line_exit_5_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from transformer.cli import preprocess
    from transformer.data import store

    def full(self, values):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store.NpyWriter, "append", full)
    out = tmp_path / "bin"
    code = preprocess.main([*corpus(tmp_path), f"preprocess.out_dir={out}", "preprocess.workers=1",
                            "preprocess.progress=false"])
    assert code == exit_codes.ENVIRONMENT
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write {out}: No space left on device" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.slow
def test_a_real_full_tmpfs_then_resume(tmp_path):
    """A 600 kB tmpfs holds one checkpoint of the tiny model (320 kB) and its logs, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = disk / "run"
        res = train(run, "trainer.max_steps=20", "checkpoint.every_steps=3", "trainer.val_every=3", cwd=tmp_path,
                    expect=exit_codes.ENVIRONMENT)
        line = one_error_line(res.stderr)
        assert "No space left on device" in line and f"last checkpoint: {run}/checkpoints/step_00000003.pt" in line
        everything_loads(run)
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        train(run, "trainer.max_steps=20", "checkpoint.every_steps=3", "trainer.val_every=3", cwd=tmp_path)
        assert load_checkpoint(run / "checkpoints" / "last.pt")["trainer"]["step"] == 20
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_run_directory_turning_read_only_is_one_line_exit_5_then_resumes(tmp_path):
    """Read-only from the start is refused before the run (exit 2, test_contract); mid-run, the next checkpoint
    write fails with EROFS."""
    run = tmp_path / "run"
    proc = popen(train_cmd(*TINY, f"hydra.run.dir={run}", "trainer.max_steps=100000", "checkpoint.every_steps=20"),
                 tmp_path)
    wait_for(lambda: step_files(run), 180, "the first checkpoint", proc)
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(run), str(run)], capture_output=True)
    if mounted.returncode != 0:
        kill_tree(proc.pid)
        pytest.skip(f"cannot bind-mount read-only here: {mounted.stderr.decode().strip()}")
    try:
        err = finish(proc)
    finally:
        subprocess.run(["umount", str(run)], capture_output=True)
    assert proc.returncode == exit_codes.ENVIRONMENT, err[-4000:]
    line = one_error_line(err)
    last = step_files(run)[-1]
    assert "Read-only file system" in line and f"last checkpoint: {last}" in line
    everything_loads(run)
    step = int(last.stem.split("_")[1])
    train(run, f"trainer.max_steps={step + 2}", cwd=tmp_path)
    assert load_checkpoint(run / "checkpoints" / "last.pt")["trainer"]["step"] == step + 2
