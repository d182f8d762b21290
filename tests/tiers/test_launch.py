"""The launch scripts: syntax, usage text, the torchrun command they build (DRY_RUN=1) from flags,
the environment or a faked Slurm job, the Slurm preemption path with fake srun/scancel/scontrol,
and (marked distributed) real torchrun launches of a stand-in `transformer.train`."""
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import SHELLCHECK, free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = [LAUNCH / "single_node.sh", LAUNCH / "multi_node.sh", LAUNCH / "slurm.sbatch"]
WRAPPER = "transformer.cli.torchrun"  # the launch scripts' torchrun: `python3 -m transformer.cli.torchrun ...`

SLURM_KEYS = [k for k in os.environ if k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))] + [
    "NNODES", "NPROC", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_PORT", "RDZV_CONF", "MAX_RESTARTS",
    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DRY_RUN", "PYTHON", "RUN_DIR", "LAUNCH_DIR", "LOCAL_ADDR"]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SLURM_KEYS}
    env.update(extra)
    return env


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def run(args, env, cwd=REPO, timeout=30):
    return subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def dry_run(script, *args, **env):
    """The words of the command a script would run, with the env assignments it prints first."""
    res = run([script, *args], clean_env(DRY_RUN="1", **env))
    assert res.returncode == 0, res.stderr
    words = shlex.split(res.stdout)
    assigns = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    return assigns, words


@pytest.fixture
def fake_bin(tmp_path):
    """A folder on PATH with a fake scontrol that expands node[001-002] and logs requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    write_exe(bin_dir / "scontrol", f"""#!/usr/bin/env bash
echo "scontrol $*" >> {log}
if [[ "$1 $2" == "show hostnames" ]]; then printf 'node001\\nnode002\\n'; fi
""")
    return bin_dir


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    res = run(["bash", "-n", script], clean_env())
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage(script):
    res = run(["bash", script, "-h"], clean_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage:")


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    res = run([SHELLCHECK, "-x", *SCRIPTS, LAUNCH / "common.sh"], clean_env())
    assert res.returncode == 0, res.stdout


def test_single_node_command():
    env, words = dry_run(LAUNCH / "single_node.sh", "experiment=copy", "trainer.max_steps=5", NPROC="3")
    cmd = words[words.index("python3"):]
    assert cmd[:7] == ["python3", "-m", WRAPPER, "--standalone", "--nnodes=1", "--nproc-per-node=3",
                       "--max-restarts=0"]
    assert cmd[7:] == ["-m", "transformer.train", "experiment=copy", "trainer.max_steps=5"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert int(env["OMP_NUM_THREADS"]) >= 1


def test_single_node_counts_visible_gpus_and_keeps_omp():
    env, words = dry_run(LAUNCH / "single_node.sh", CUDA_VISIBLE_DEVICES="2,5", OMP_NUM_THREADS="7")
    assert "--nproc-per-node=2" in words
    assert env["OMP_NUM_THREADS"] == "7"


def test_single_node_counts_nvidia_smi_gpus(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "nvidia-smi", """#!/bin/sh
echo "GPU 0: NVIDIA H100 (UUID: GPU-a)"
echo "  MIG 1g.10gb Device 0: (UUID: MIG-b)"
echo "GPU 1: NVIDIA H100 (UUID: GPU-c)"
""")
    _, words = dry_run(LAUNCH / "single_node.sh", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert "--nproc-per-node=2" in words


def test_double_dash_passes_help_to_trainer():
    _, words = dry_run(LAUNCH / "single_node.sh", "--", "--help", NPROC="1")
    assert words[-3:] == ["-m", "transformer.train", "--help"]


def test_multi_node_from_flags():
    env, words = dry_run(LAUNCH / "multi_node.sh", "--nnodes", "2", "--rdzv-endpoint=head:29400",
                         "--rdzv-id", "run7", "--nproc-per-node=4", "--max-restarts", "5",
                         "model=big", "--cfg", "job")
    cmd = words[words.index("python3"):]
    assert cmd == ["python3", "-m", WRAPPER, "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=head:29400", "--rdzv-id=run7", "--max-restarts=5",
                   "-m", "transformer.train", "model=big", "--cfg", "job"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_multi_node_local_addr_from_flag_or_env():
    _, words = dry_run(LAUNCH / "multi_node.sh", "--nnodes=2", "--rdzv-endpoint=h:1", "--rdzv-id=a",
                       "--local-addr", "10.1.2.3", "x=1")
    assert words[-4:] == ["--local-addr=10.1.2.3", "-m", "transformer.train", "x=1"]
    _, words = dry_run(LAUNCH / "multi_node.sh", "--nnodes=2", "--rdzv-endpoint=h:1", "--rdzv-id=a",
                       LOCAL_ADDR="127.0.0.1")
    assert "--local-addr=127.0.0.1" in words
    _, words = dry_run(LAUNCH / "multi_node.sh", "--nnodes=2", "--rdzv-endpoint=h:1", "--rdzv-id=a")
    assert not any(w.startswith("--local-addr") for w in words)


def test_multi_node_from_slurm(fake_bin, tmp_path):
    env, words = dry_run(LAUNCH / "multi_node.sh", "experiment=copy",
                         PATH=f"{fake_bin}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2",
                         SLURM_JOB_NODELIST="node[001-002]", CUDA_VISIBLE_DEVICES="0,1,2,3",
                         SLURM_CPUS_ON_NODE="32")
    assert "--nnodes=2" in words
    assert "--rdzv-endpoint=node001:24242" in words  # 20000 + 4242 % 20000
    assert "--rdzv-id=4242" in words
    assert "--nproc-per-node=4" in words
    assert "--max-restarts=3" in words
    assert env["OMP_NUM_THREADS"] == "8"
    assert "scontrol show hostnames node[001-002]" in (tmp_path / "calls.log").read_text()


def test_multi_node_flags_and_env_beat_slurm(fake_bin):
    _, words = dry_run(LAUNCH / "multi_node.sh", "--nnodes=1:4", "x=1", PATH=f"{fake_bin}:{os.environ['PATH']}",
                       SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[001-002]",
                       RDZV_PORT="31000", MAX_RESTARTS="0", NPROC="1")
    assert "--nnodes=1:4" in words
    assert "--rdzv-endpoint=node001:31000" in words
    assert "--max-restarts=0" in words


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "number of nodes unknown"),
    (["--nnodes", "2"], {}, "no rendezvous endpoint"),
    (["--nnodes", "two", "--rdzv-endpoint", "h:1"], {}, "--nnodes must be"),
    (["--nnodes", "2", "--rdzv-endpoint", "h"], {}, "HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc-per-node", "0"], {}, "--nproc-per-node must be"),
    (["--nnodes"], {}, "--nnodes needs a value"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], {}, "no rendezvous id"),
])
def test_multi_node_bad_input(args, env, message):
    res = run([LAUNCH / "multi_node.sh", *args], clean_env(DRY_RUN="1", **env))
    assert res.returncode == 2
    assert message in res.stderr and res.stdout == ""


def test_missing_python_is_one_clear_line(tmp_path):
    res = run([LAUNCH / "single_node.sh", "experiment=copy"], clean_env(PYTHON=str(tmp_path / "python3"), NPROC="1"))
    assert res.returncode == 2
    assert f"'{tmp_path / 'python3'}' not found" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_python_without_the_project_is_one_clear_line(tmp_path):
    """A Python that cannot import the project (another environment's): refused before torchrun starts."""
    bare = write_exe(tmp_path / "python3", f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages
    res = run([LAUNCH / "single_node.sh", "experiment=copy"], clean_env(PYTHON=str(bare), NPROC="1"), cwd=tmp_path)
    assert res.returncode == 2
    assert "cannot import the project" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_sbatch_outside_slurm_fails_clearly():
    res = run(["bash", LAUNCH / "slurm.sbatch"], clean_env())
    assert res.returncode == 2 and "not inside a Slurm job" in res.stderr


@pytest.mark.parametrize("codes, code", [
    ({0: 3, 1: 3}, 3),
    ({0: -15, 1: 3}, 3),  # rank 1 exited first; the agent's SIGTERM caught rank 0 closing its logs
    ({0: 130, 1: 130}, 130),
    ({0: 5, 1: 3}, 5),  # rank 0's full disk, as it said in its one line
    ({0: 0, 1: 2}, 2),
    ({0: 1, 1: -15}, None),  # a crash: torchrun restarts or reports it
    ({0: -9, 1: 3}, None),
    ({0: -15, 1: -15}, None),
    ({}, None),
])
def test_final_code_of_the_workers(codes, code):
    from transformer.cli.torchrun import final_code

    assert final_code(codes) == code


# --- The Slurm preemption path, with fake srun / scancel / scontrol / torchrun -----------------

def slurm_fakes(bin_dir: Path, tmp_path: Path, step_exit: str) -> dict:
    """srun runs its command; torchrun (python3 -m transformer.cli.torchrun) logs its args and pid, then either
    exits `step_exit` (a number) or, with step_exit='wait', waits for TERM and exits 3 like the trainer."""
    log = tmp_path / "calls.log"
    pid_file = tmp_path / "torchrun.pid"
    write_exe(bin_dir / "srun", f"""#!/usr/bin/env bash
echo "srun $*" >> {log}
while [[ "$1" == --* ]]; do shift; done
exec "$@"
""")
    write_exe(bin_dir / "scancel", f"""#!/usr/bin/env bash
echo "scancel $*" >> {log}
kill -s "${{1#--signal=}}" "$(cat {pid_file})"
""")
    body = ("trap 'echo worker got TERM >> " + str(log) + "; exit 3' TERM\n"
            "while true; do sleep 0.05; done") if step_exit == "wait" else f"exit {step_exit}"
    write_exe(bin_dir / "python3", f"""#!/usr/bin/env bash
[[ "$1" == -c ]] && exit 0  # the launch script's check that this Python has the project
[[ "$1 $2" == "-m {WRAPPER}" ]] || exit 99
shift 2
echo "torchrun $*" >> {log}
echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}
{body}
""")
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="node[001-002]", SLURM_SUBMIT_DIR=str(REPO), NPROC="8")


def start_sbatch(env, *args):
    return subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), *args], env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("sig, requeues", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_sbatch_forwards_signal_and_requeues(fake_bin, tmp_path, sig, requeues):
    env = slurm_fakes(fake_bin, tmp_path, step_exit="wait")
    proc = start_sbatch(env, "experiment=copy")
    try:
        wait_for(tmp_path / "torchrun.pid")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    calls = (tmp_path / "calls.log").read_text()
    assert proc.returncode == (0 if requeues else 3), out
    assert "scancel --signal=TERM 4242" in calls
    assert "worker got TERM" in calls
    assert ("scontrol requeue 4242" in calls) == requeues
    torchrun = next(line for line in calls.splitlines() if line.startswith("torchrun "))
    words = torchrun.split()
    assert "--nnodes=2" in words and "--rdzv-id=4242" in words and "--nproc-per-node=8" in words
    assert "--rdzv-endpoint=node001:24242" in words
    assert words[-2:] == ["experiment=copy", "hydra.run.dir=outputs/slurm-4242"]
    assert "srun --ntasks=2 --ntasks-per-node=1" in calls


@pytest.mark.parametrize("step_exit, requeues", [("0", False), ("1", False), ("3", True)])
def test_sbatch_requeues_only_preempted_steps(fake_bin, tmp_path, step_exit, requeues):
    env = slurm_fakes(fake_bin, tmp_path, step_exit=step_exit)
    proc = start_sbatch(env, "hydra.run.dir=/runs/mine")
    out, _ = proc.communicate(timeout=20)
    calls = (tmp_path / "calls.log").read_text()
    assert proc.returncode == (0 if requeues else int(step_exit)), out
    assert ("scontrol requeue 4242" in calls) == requeues
    assert "scancel" not in calls
    torchrun = next(line for line in calls.splitlines() if line.startswith("torchrun "))
    assert torchrun.count("hydra.run.dir=") == 1 and torchrun.endswith(" hydra.run.dir=/runs/mine")


# --- Real torchrun, a stand-in trainer ------------------------------------------------------

FAKE_TRAIN = """import os, sys, time
rank = os.environ["RANK"]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
fail_first = os.environ.get("FAIL_FIRST_ATTEMPT") == "1"
record = lambda r: os.path.join(os.environ["OUT_DIR"], f"rank{r}.attempt{attempt}")
with open(record(rank), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"],
                      os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "-")] + sys.argv[1:]))
# The agent stops the other workers as soon as one ends with an error: wait until every worker of this attempt has
# written its record, or a slow-starting one is stopped before it does (seen under coverage's process start-up).
deadline = time.monotonic() + 60
while not all(os.path.exists(record(r)) for r in range(int(os.environ["WORLD_SIZE"]))) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(1 if fail_first and attempt == 0 else int(os.environ.get("EXIT_CODE", "0")))
"""


@pytest.fixture
def stand_in(tmp_path):
    """A folder holding a fake `transformer.train` that records who it is; torchrun's workers run
    `python -m transformer.train` from the current folder, so running there picks it up. The rest of the
    package (transformer.cli.torchrun, the agent) is the real one."""
    pkg = tmp_path / "transformer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"__path__.append({str(REPO / 'transformer')!r})\n")
    (pkg / "train.py").write_text(FAKE_TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(PYTHON=sys.executable, OUT_DIR=str(out), PYTHONPATH=str(tmp_path))
    return tmp_path, out, env


@pytest.mark.distributed
def test_single_node_really_launches(stand_in):
    cwd, out, env = stand_in
    env["NPROC"] = "2"
    res = run([LAUNCH / "single_node.sh", "experiment=copy"], env, cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    records = sorted(p.name for p in out.iterdir())
    assert records == ["rank0.attempt0", "rank1.attempt0"]
    world, local, group, share, *args = (out / "rank1.attempt0").read_text().split()
    assert (world, local, group, share, args) == ("2", "1", "0", "1", ["experiment=copy"])


@pytest.mark.distributed
@pytest.mark.parametrize("code, attempts", [(3, 1), (1, 2)], ids=["stopped", "crashed"])
def test_only_crashed_workers_restart(stand_in, code, attempts):
    """Workers that end with a code of the trainer's own (3: stopped by a signal the agent did not see, say on
    another node) are not restarted under --max-restarts: the agent ends with their code and no traceback. A
    crash (1) is restarted and reported as torchrun does."""
    cwd, out, env = stand_in
    env.update(NPROC="2", MAX_RESTARTS="1", EXIT_CODE=str(code))
    res = run([LAUNCH / "single_node.sh", "x=1"], env, cwd=cwd, timeout=120)
    assert res.returncode == code, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"rank{r}.attempt{a}" for r in (0, 1) for a in range(attempts))
    assert ("Traceback" in res.stderr) == (code == 1), res.stderr[-3000:]


@pytest.mark.distributed
def test_multi_node_two_agents_rendezvous_and_restart(stand_in):
    """Two torchrun agents on this machine play two nodes; the first attempt fails everywhere, so
    the c10d rendezvous must re-form the group once (--max-restarts=1)."""
    cwd, out, env = stand_in
    env.update(FAIL_FIRST_ATTEMPT="1", NPROC="1")
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [LAUNCH / "multi_node.sh", "--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=t1",
           "--max-restarts=1", "x=1"]
    agents = [subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = []
    try:
        for a in agents:
            logs.append(a.communicate(timeout=180)[0])
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert sorted(p.name for p in out.iterdir()) == [
        "rank0.attempt0", "rank0.attempt1", "rank1.attempt0", "rank1.attempt1"]
    groups = sorted((out / f"rank{r}.attempt1").read_text().split()[2] for r in (0, 1))
    assert groups == ["0", "1"]
    assert (out / "rank0.attempt1").read_text().split()[0] == "2"


# --- Real torchrun, the real trainer --------------------------------------------------------

@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_at_a_terminal_ends_like_spawn(tmp_path, presses):
    """Ctrl-C at a terminal reaches the whole foreground process group: the launch script's torchrun agent and
    its two workers. The run ends as under the trainer's own spawn: a first Ctrl-C with the workers' exit code 3,
    no traceback and one resume hint naming the run directory; a second one, a second later, with 130. Steps
    slow enough (a wider model, long sequences) that the stop is still pending when the second comes."""
    from tests.helpers.dist import TINY, env_for, finish, step_files, wait_for
    from transformer.training.launcher import SAME_CTRL_C_S

    run_dir = tmp_path / "run"
    wide = ("model.d_model=256", "model.d_ff=1024", "model.N=2", "data.copy.seq_len=60", "data.max_tokens=6000",
            "checkpoint.every_steps=1") if presses == 2 else ("checkpoint.every_steps=30",)
    cmd = [LAUNCH / "single_node.sh", *TINY, f"hydra.run.dir={run_dir}", "trainer.max_steps=100000",
           "trainer.accelerator=cpu", *wide]
    # A terminal starts a command in a process group of its own and sends Ctrl-C's SIGINT to all of it.
    proc = subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env_for(PYTHON=sys.executable, NPROC="2", MAX_RESTARTS="2"), text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: step_files(run_dir), 180, "the first checkpoint", proc)
        os.killpg(proc.pid, signal.SIGINT)
        if presses == 2:
            time.sleep(SAME_CTRL_C_S + 0.3)
            os.killpg(proc.pid, signal.SIGINT)
        err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    if presses == 1:
        assert proc.returncode == 3, err[-4000:]
        assert err.count("to resume") == 1 and f"hydra.run.dir={run_dir} to resume" in err, err[-4000:]
    else:
        assert proc.returncode == 130, err[-4000:]
        assert err.count("aborted by a second Ctrl-C") == 1 and "stopped by a signal" not in err, err[-4000:]
    assert "hydra.run.dir=None" not in err
