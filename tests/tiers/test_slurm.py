"""launch/slurm.sbatch and hydra/launcher=slurm on a real Slurm (issue 14).

Marked `slurm`: jobs go through the real sbatch, srun, scancel and scontrol of the one-node cluster
that launch/ci/run-slurm-tier.sh starts (`make test-slurm`); without it they are skipped.
- sbatch launch/slurm.sbatch with 2 CPU workers runs to completion; run dir, log and checkpoints
  where the README says;
- preemption: USR1 to the batch shell (Slurm's time-limit warning), then `scontrol requeue` (what a
  preempting scheduler does): each time the workers checkpoint and exit 3, Slurm requeues the job,
  it resumes in the same run dir and ends bit-identical to the uninterrupted job; Restarts=2;
- `transformer-train -m hydra/launcher=slurm ... model.norm_first=false,true` (hydra-submitit-launcher)
  submits two jobs that both finish, one run dir each.
Also marked `slurm`, with no cluster: the launcher's setup lines export a free MASTER_PORT and
SLURM_KILL_BAD_EXIT, and dist.torchrun_env keeps that port under submitit.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.dist import TINY, assert_same_state, env_for, files_under, last_ckpt, step_files
from tests.tiers.test_distributed import LONG

REPO = Path(__file__).resolve().parents[2]
TIER = REPO / "launch" / "ci" / "run-slurm-tier.sh"
SBATCH = REPO / "launch" / "slurm.sbatch"
BIN = str(Path(sys.executable).parent)  # torchrun and transformer-train, for the jobs
# 200 steps: room for two cuts after the first checkpoints (about 15 s of training on 2 cores).
STEPS = 200
RUN = (*TINY, *LONG, "trainer.log_every=50", "trainer.accelerator=cpu")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
JOB_TIMEOUT = 300


def test_tier_script_parses_and_helps():
    assert subprocess.run(["bash", "-n", str(TIER)], capture_output=True).returncode == 0
    res = subprocess.run(["bash", str(TIER), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("CI's Slurm tier") and "set -euo" not in res.stdout


def test_tier_skips_without_root():
    if os.geteuid() == 0:
        pytest.skip("runs as root here")
    res = subprocess.run(["bash", str(TIER)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 77 and "SKIP: needs root" in res.stdout


# ---- hydra/launcher=slurm, no cluster needed (submitit is the `slurm` extra) ------------------------------
@pytest.mark.slurm
def test_launcher_setup_exports_a_free_port_and_kill_on_bad_exit():
    """The sbatch setup lines of conf/hydra/launcher/slurm.yaml, run by bash: a MASTER_PORT free on this host
    (submitit's default, a hash of the job id, hung a CI run when something held it) and SLURM_KILL_BAD_EXIT."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"hydra": {"launcher": OmegaConf.load(REPO / "conf/hydra/launcher/slurm.yaml")}})
    setup = OmegaConf.to_container(cfg.hydra.launcher.setup, resolve=True)
    script = "\n".join(["set -e", *setup, 'echo "$MASTER_PORT $SLURM_KILL_BAD_EXIT $OMP_NUM_THREADS"'])
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    port, kill_bad_exit, threads = res.stdout.split()
    assert (kill_bad_exit, threads) == ("1", str(cfg.hydra.launcher.cpus_per_task))
    with socket.socket() as s:  # still free: rank 0's store can listen on it
        s.bind(("", int(port)))


@pytest.mark.slurm
def test_submitit_ranks_keep_the_jobs_master_port(monkeypatch):
    """dist.torchrun_env under hydra/launcher=slurm: ranks from Slurm's variables, MASTER_PORT from the job's
    setup kept (submitit's export refuses to write over it unless told to)."""
    pytest.importorskip("submitit")
    from transformer import dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2",
                        "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node1",
                        "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    assert dist.torchrun_env() == {"rank": 1, "local_rank": 1, "world_size": 2, "local_world_size": 2}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node1", "23456")


# ---- a real cluster --------------------------------------------------------------------------------------
def slurm_env(**extra) -> dict:
    """The tests' job environment (sbatch exports it to the job): no launcher variables from outside,
    the cluster's SLURM_CONF, this interpreter's torchrun on PATH, and LOCAL_ADDR (multi_node.sh
    --local-addr) so that torchrun gives the workers 127.0.0.1, not whatever the host name resolves to."""
    return env_for(SLURM_CONF=os.environ.get("SLURM_CONF", ""), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
                   LOCAL_ADDR="127.0.0.1", **extra)


@pytest.fixture(scope="module")
def cluster():
    if not os.environ.get("SLURM_CONF") or shutil.which("sbatch") is None:
        pytest.skip("no Slurm cluster: run launch/ci/run-slurm-tier.sh (make test-slurm), which starts one")
    res = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=slurm_env(), timeout=30)
    if res.returncode != 0:
        pytest.skip(f"scontrol ping failed (SLURM_CONF={os.environ['SLURM_CONF']}): {res.stdout}{res.stderr}")


def slurm(*args: str, cwd: Path = REPO, env=None) -> str:
    res = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, env=env or slurm_env(), timeout=60)
    assert res.returncode == 0, f"{' '.join(args)} exited {res.returncode}: {res.stderr}"
    return res.stdout


def job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    out = slurm("scontrol", "show", "job", "-o", job_id)
    return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out))


def submit(cwd: Path, *args: str, env=None) -> str:
    return slurm("sbatch", "--parsable", *args, cwd=cwd, env=env).strip().split(";")[0]


def job_log(cwd: Path, job_id: str) -> str:
    path = cwd / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path.name})"


def wait_until(predicate, what: str, cwd: Path, job_id: str, timeout: float = JOB_TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if job(job_id).get("JobState") in FINAL:
            break
        time.sleep(0.5)
    value = predicate()
    if value:
        return value
    state = job(job_id)
    subprocess.run(["scancel", job_id], env=slurm_env(), capture_output=True)
    raise AssertionError(f"job {job_id} ({state.get('JobState')}, Restarts={state.get('Restarts')}): gave up "
                         f"waiting for {what}\n{job_log(cwd, job_id)[-6000:]}")


def wait_done(cwd: Path, job_id: str) -> dict[str, str]:
    wait_until(lambda: job(job_id).get("JobState") in FINAL, "the end of the job", cwd, job_id)
    return job(job_id)


def stops(log: str) -> list:
    """Steps at which rank 0 stopped on a signal (rank 1 says so too, prefixed "[rank 1]")."""
    return [int(s) for s in re.findall(r"^\[[\d:]+\] stopped by a signal at step (\d+)", log, re.M)]


def sbatch_cmd(*overrides: str, steps: int = STEPS) -> tuple:
    """The README's sbatch line for 2 CPU workers on one node (with NPROC=2)."""
    return ("--cpus-per-task=2", str(SBATCH), *RUN, f"trainer.max_steps={steps}", *overrides)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """sbatch launch/slurm.sbatch ... with 2 CPU workers, never interrupted: the reference."""
    cwd = tmp_path_factory.mktemp("sbatch")
    job_id = submit(cwd, *sbatch_cmd(), env=slurm_env(NPROC="2"))
    info = wait_done(cwd, job_id)
    return cwd, job_id, info


@pytest.mark.slurm
def test_sbatch_two_cpu_workers_run_to_completion(uninterrupted):
    cwd, job_id, info = uninterrupted
    out = job_log(cwd, job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-6000:]
    # The README's places: slurm-<jobid>.out and outputs/slurm-<jobid>/ in the submit folder, nothing else.
    run = cwd / "outputs" / f"slurm-{job_id}"
    assert sorted(p.name for p in cwd.iterdir()) == ["outputs", f"slurm-{job_id}.out"]
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "checkpoints", "metrics.jsonl", "run.lock",
                                                     "tensorboard", "train.log"], files_under(cwd)
    assert f"slurm.sbatch: job {job_id} on 1 node(s), restart 0" in out
    assert "2 worker(s) on cpu" in out and f"test step {STEPS}" in out
    ck = last_ckpt(run)
    assert (ck["trainer"]["step"], ck["trainer"]["world_size"]) == (STEPS, 2)
    assert (run / "checkpoints" / "best.pt").is_file()


@pytest.mark.slurm
def test_sbatch_preempted_twice_requeues_and_matches(uninterrupted, tmp_path):
    """USR1 to the batch shell (as Slurm sends it before the time limit), then, once the requeued job
    has resumed, `scontrol requeue` (a preemption): each time the workers checkpoint and exit 3, the job
    is requeued and continues in outputs/slurm-<jobid>; the end equals the uninterrupted job bit for bit."""
    ref_cwd, ref_id, _ = uninterrupted
    job_id = submit(tmp_path, *sbatch_cmd(), env=slurm_env(NPROC="2"))
    run = tmp_path / "outputs" / f"slurm-{job_id}"

    def checkpoint_after(step: int):
        return [p for p in step_files(run) if int(p.stem.split("_")[1]) > step]

    wait_until(lambda: checkpoint_after(10), "a checkpoint past step 10", tmp_path, job_id)
    slurm("scancel", "--signal=USR1", "--batch", job_id)
    wait_until(lambda: job(job_id).get("Restarts") == "1", "the requeue after USR1", tmp_path, job_id)
    out = job_log(tmp_path, job_id)
    assert len(stops(out)) == 1, out[-6000:]
    first = stops(out)[0]
    resumed = wait_until(lambda: re.findall(r"resumed from \S+ at step (\d+)", job_log(tmp_path, job_id)),
                         "the resumed run", tmp_path, job_id)
    assert resumed == [str(first)]
    wait_until(lambda: checkpoint_after(first + 20), f"a checkpoint past step {first + 20}", tmp_path, job_id)
    slurm("scontrol", "requeue", job_id)
    info = wait_done(tmp_path, job_id)
    out = job_log(tmp_path, job_id)

    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), out[-6000:]
    cuts = stops(out)
    assert len(cuts) == 2 and first == cuts[0] < cuts[1] < STEPS, out[-6000:]
    assert re.findall(r"resumed from \S+ at step (\d+)", out) == [str(s) for s in cuts]
    assert "got SIGUSR1" in out and f"requeueing job {job_id}" in out
    assert [f"restart {n}" in out for n in range(3)] == [True, True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", f"slurm-{job_id}.out"]
    assert_same_state(last_ckpt(run), last_ckpt(ref_cwd / "outputs" / f"slurm-{ref_id}"))


@pytest.mark.slurm
def test_sbatch_continues_a_finished_run(uninterrupted, tmp_path):
    """A job that has ended (here at trainer.max_steps=100) is continued by a new job given its run dir:
    it resumes from the last checkpoint and ends like the job that ran all the way."""
    ref_cwd, ref_id, _ = uninterrupted
    env = slurm_env(NPROC="2")
    first = submit(tmp_path, *sbatch_cmd(steps=100), env=env)
    assert wait_done(tmp_path, first)["JobState"] == "COMPLETED", job_log(tmp_path, first)[-6000:]
    run = f"outputs/slurm-{first}"
    second = submit(tmp_path, *sbatch_cmd(f"hydra.run.dir={run}"), env=env)
    info = wait_done(tmp_path, second)
    out = job_log(tmp_path, second)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-6000:]
    assert re.search(r"resumed from \S+ at step 100 ", out), out[-6000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", f"slurm-{first}.out", f"slurm-{second}.out"]
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [f"slurm-{first}"]
    assert_same_state(last_ckpt(tmp_path / run), last_ckpt(ref_cwd / "outputs" / f"slurm-{ref_id}"))


def sweep_logs(sweep: Path) -> str:
    """The tails of the submitted jobs' logs (.submitit/<job>/*.out and *.err, one per Slurm task)."""
    return "\n".join(f"--- {p.relative_to(sweep)}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(sweep.glob(".submitit/*/*_log.*")))


@pytest.mark.slurm
def test_hydra_submitit_launcher_sweep(cluster, tmp_path):
    """transformer-train -m hydra/launcher=slurm: one Slurm job per sweep point, both finish, each
    in its own run dir (here 2 Slurm tasks per job on CPU: ranks from SLURM_PROCID through submitit)."""
    sweep = tmp_path / "multirun"
    cmd = [str(Path(BIN) / "transformer-train"), "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
           f"hydra.sweep.dir={sweep}", *TINY, "trainer.max_steps=6", "trainer.val_every=3",
           "trainer.accelerator=cpu", "model.norm_first=false,true"]
    try:
        res = subprocess.run(cmd, cwd=tmp_path, env=slurm_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired as e:  # the jobs' own logs say where they hang; the tier deletes them
        raise AssertionError(f"no result in {JOB_TIMEOUT} s\n{sweep_logs(sweep)}") from e
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}\n{sweep_logs(sweep)}"
    # One job array, one task (a job of its own) per sweep point: .submitit/<array id>_<index>
    job_ids = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, files_under(sweep)
    for job_id in job_ids:  # the results come back a moment before Slurm has closed the jobs
        assert wait_done(sweep, job_id)["JobState"] == "COMPLETED"
    for i, norm_first in enumerate((False, True)):
        ck = last_ckpt(sweep / str(i))
        assert ck["trainer"]["step"] == 6 and ck["trainer"]["world_size"] == 2
        assert ck["config"]["model"]["norm_first"] is norm_first
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1"]
