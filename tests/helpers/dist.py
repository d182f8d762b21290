"""Helpers for the distributed and resume tests: tiny training runs through the real CLI (plain,
spawned workers, torchrun), joining a gloo group from a spawned worker, finding worker pids in /proc, and
comparing checkpoints bit for bit."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as torch_dist

# The comparisons live in their own module (no pytest there: the Docker tier runs it in the image).
from tests.helpers.checkpoints import assert_same_state, assert_same_weights  # noqa: F401
from tests.helpers.cli import cli_env, free_port, train_cmd
from transformer import dist
from transformer.training.components.checkpoint import load_checkpoint

# A model and data small enough that a run is dominated by interpreter start-up. 640 copy examples make
# 6 token-batches for any world size in {1, 2} (no batch needs splitting), so 1 worker with accumulate=2
# and 2 workers step through the very same global batches (3 optimiser steps an epoch).
TINY = ("experiment=copy", "data.copy.train_size=640", "data.copy.val_size=48", "data.copy.test_size=16",
        "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "trainer.progress=false",
        "trainer.max_epochs=null", "trainer.log_every=1")
TIMEOUT = 240  # seconds per CLI run: generous, the CI machine has 2 cores shared with other jobs


def join_gloo(rank: int, world_size: int, port: int) -> dist.DistEnv:
    """A spawned test worker joins a gloo group on 127.0.0.1:`port` (rank 0 hosts the store); leave with
    dist.close(). Through dist.init, not a bare init_process_group: it records the rank that rank_zero reads,
    without which every rank writes files as rank 0 (two writers of one best.pt link race)."""
    store = torch_dist.TCPStore("127.0.0.1", port, world_size, rank == 0)
    return dist.init(rank, rank, world_size, "cpu", 120, store=store)


def env_for(**extra) -> dict:
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    # No launcher variables from the outside may leak into a test's workers.
    for k in list(env):
        if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK") \
                or k.startswith(("TORCHELASTIC_", "PET_", "SLURM_")):
            del env[k]
    env.update(extra)
    return env


def torchrun_cmd(*overrides: str, nproc: int = 2, nnodes: int = 1, rdzv_id: Optional[str] = None,
                 endpoint: Optional[str] = None, max_restarts: int = 0) -> List[str]:
    """`torchrun ... -m transformer.train <overrides>` with a c10d rendezvous on 127.0.0.1 only."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint or f'127.0.0.1:{free_port()}'}",
            f"--rdzv-id={rdzv_id or 'test'}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
            "--local-addr=127.0.0.1", "-m", "transformer.train", *overrides]


def run_cli(cmd: Sequence[str], cwd: Path, env: Optional[dict] = None, expect: Optional[int] = 0,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), cwd=cwd, env=env or env_for(), capture_output=True, text=True,
                         timeout=timeout)
    if expect is not None:
        assert res.returncode == expect, (f"exit code {res.returncode} (expected {expect}) from {' '.join(cmd)}\n"
                                          f"--- stderr ---\n{res.stderr[-6000:]}")
    return res


def train(run_dir: Path, *overrides: str, cwd: Path, expect: Optional[int] = 0, **kw):
    """One plain/spawn CLI run into `run_dir`."""
    return run_cli(train_cmd(*TINY, f"hydra.run.dir={run_dir}", *overrides), cwd, expect=expect, **kw)


def torchrun(run_dir: Optional[Path], *overrides: str, cwd: Path, expect: Optional[int] = 0, nproc: int = 2,
             env: Optional[dict] = None, **kw):
    rd = (f"hydra.run.dir={run_dir}",) if run_dir is not None else ()
    return run_cli(torchrun_cmd(*TINY, *rd, *overrides, nproc=nproc, **kw), cwd, env=env, expect=expect)


def last_ckpt(run_dir: Path) -> dict:
    return load_checkpoint(Path(run_dir) / "checkpoints" / "last.pt")


# ---- processes -------------------------------------------------------------------------------------------
def children(pid: int) -> List[int]:
    """Direct children of `pid`, from /proc (no psutil)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def environ(pid: int) -> Dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def spawned_workers(parent: int) -> List[int]:
    """Worker processes of the spawn path (not multiprocessing's resource tracker)."""
    return [p for p in children(parent) if "spawn_main" in cmdline(p)]


def torchrun_workers(agent: int) -> Dict[int, int]:
    """{global rank: pid} of a torchrun agent's worker processes."""
    found = {}
    for p in children(agent):
        rank = environ(p).get("RANK")
        if rank is not None and "transformer.train" in cmdline(p):
            found[int(rank)] = p
    return found


def wait_for(predicate: Callable[[], object], timeout: float, what: str, proc: Optional[subprocess.Popen] = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"process exited ({proc.returncode}) before {what}\n{out[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def step_files(run_dir: Path) -> List[Path]:
    folder = Path(run_dir) / "checkpoints"
    return sorted(folder.glob("step_*.pt")) if folder.is_dir() else []


def popen(cmd: Sequence[str], cwd: Path, env: Optional[dict] = None) -> subprocess.Popen:
    return subprocess.Popen(list(cmd), cwd=cwd, env=env or env_for(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """Waits for `proc`; kills its whole tree if it hangs (and fails)."""
    try:
        _, err = proc.communicate(timeout=timeout)
        return err
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _, err = proc.communicate()
        raise AssertionError(f"hung: killed after {timeout}s\n{err[-6000:]}") from None


def kill_tree(pid: int) -> None:
    for c in children(pid):
        kill_tree(c)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def files_under(folder: Path) -> List[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


