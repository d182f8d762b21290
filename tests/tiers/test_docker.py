"""The Docker tier (docker/ci/run-docker-tier.sh): its own fast checks, and (marked docker) the
whole tier: a private dockerd, a debootstrapped base, an offline build of docker/Dockerfile, a short
training run in the container whose exit code and checkpoint are checked, and two containers as two
nodes (multi_node.sh on the host network, 127.0.0.1): only global rank 0 writes, and a job whose second
container is killed and started again ends bit-identical to the uninterrupted one."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cli import SHELLCHECK

REPO = Path(__file__).resolve().parents[2]
TIER = REPO / "docker" / "ci" / "run-docker-tier.sh"


def run_tier(*args, env=None, timeout=30):
    """The tier script's result; past `timeout` it gets TERM (its cleanup stops dockerd), then KILL."""
    proc = subprocess.Popen(["bash", str(TIER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"{TIER.name} ran past {timeout}s\n{out[-6000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_tier_script_parses():
    res = subprocess.run(["bash", "-n", str(TIER)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_tier_help():
    res = run_tier("--help")
    assert res.returncode == 0
    assert "Usage: docker/ci/run-docker-tier.sh" in res.stdout and "set -euo" not in res.stdout


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
def test_tier_shellcheck_clean():
    res = subprocess.run([SHELLCHECK, "-x", str(TIER)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


DEB822 = """\
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://off.example/debian
Suites: bookworm
Enabled: no

# a comment
Types: deb
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
"""


@pytest.mark.parametrize("files, want", [
    ({"sources.list.d/debian.sources": DEB822}, "http://mirror.example/debian"),
    ({"sources.list": "deb [signed-by=/k.gpg arch=amd64] http://one.example/debian bookworm main\n"},
     "http://one.example/debian"),
    ({"sources.list": "deb http://sec.example/ds bookworm-security main\ndeb http://two.example/d bookworm main\n"},
     "http://two.example/d"),
    ({"sources.list.d/x.sources": "Types: deb\nURIs: http://u.example/ubuntu\nSuites: jammy\n"},
     "http://deb.debian.org/debian"),
    ({}, "http://deb.debian.org/debian"),
])
def test_mirror_from_apt_sources(tmp_path, files, want):
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    res = run_tier("--mirror", env={"APT_ETC": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == want


def test_dockerignore_keeps_what_the_image_needs():
    """The build COPYs setup.cfg, pyproject.toml and the whole tree; none of it may be ignored,
    and the heavy or private folders must be."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for needed in ("setup.cfg", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "transformer", "conf",
                   "launch"):
        assert needed not in patterns
    for heavy in (".git", "outputs", "multirun", ".venv", "data", "**/*.pt", "**/__pycache__"):
        assert heavy in patterns


@pytest.mark.docker
@pytest.mark.timeout(1800)  # a fresh machine took about 15 min here (apt, debootstrap, wheels, build, 2 nodes)
def test_docker_tier_end_to_end():
    if os.geteuid() != 0:
        pytest.skip("the Docker tier needs root (apt-get, dockerd)")
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        pytest.skip("neither apt-get nor dockerd on this machine")
    res = run_tier(timeout=1500)
    out = res.stdout + res.stderr
    if res.returncode == 77:
        pytest.skip(out.strip().splitlines()[-1])
    print(out)  # phase timings; shown with -rA or -s
    assert res.returncode == 0, out[-6000:]
    assert "[docker-tier] OK" in out
    assert "runs as uid" in out and "checkpoints:" in out
    # Two containers as two nodes: both exit 0, one uid wrote everything, and the job whose second node
    # was killed and started again ends with the uninterrupted job's weights.
    for job in ("plain", "restart"):
        assert f"{job}: both containers exited 0; global rank 0 in {job}-node" in out
    assert "docker kill restart-node1" in out and "resumed from" in out
    assert "killed and restarted vs uninterrupted: final weights bit-identical" in out
