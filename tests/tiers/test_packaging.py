"""The package as installed software: recipes found inside a wheel or in the clone, a user's own recipe folder
(--config-dir), `transformer-train --version`, what setup.py puts into the build, the Makefile's two installs,
and the wheel tier's script (launch/ci/run-wheel-tier.sh, `make test-wheel`, runs the whole thing;
test_lint.py shellchecks it)."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import transformer
from tests.helpers.cli import cli_env, train_cmd
from transformer.config import CONF_DIR, conf_dir

REPO = Path(__file__).resolve().parents[2]
WHEEL_TIER = REPO / "launch" / "ci" / "run-wheel-tier.sh"

# A recipe of the user's own, in a folder of theirs: an experiment on top of the copy task.
MINE = """\
# @package _global_
defaults:
  - override /model: tiny
  - override /data: copy

model:
  d_model: 48
trainer:
  max_steps: 7
"""


def test_conf_dir_is_the_wheels_copy_else_the_clones(tmp_path):
    package = tmp_path / "transformer"
    package.mkdir()
    assert conf_dir(package) == tmp_path / "conf"  # editable: the top-level conf/, edited in place
    (package / "conf").mkdir()
    assert conf_dir(package) == package / "conf"  # a wheel: setup.py copied conf/ there
    assert CONF_DIR == REPO / "conf"  # this checkout


def test_commit_recorded_by_a_build_else_git_else_unknown(tmp_path):
    package = tmp_path / "transformer"
    package.mkdir()
    assert transformer.commit(package) == "unknown"  # no record, no git
    (tmp_path / ".git").mkdir()  # looks like a clone, but git cannot read it
    assert transformer.commit(package) == "unknown"
    (package / "_commit.txt").write_text("abc1234\n")
    assert transformer.commit(package) == "abc1234"
    if shutil.which("git") and (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert re.fullmatch(re.escape(head) + r"(-dirty)?", transformer.commit())


def test_version_flag_prints_version_and_commit_and_writes_nothing(tmp_path):
    r = subprocess.run(train_cmd("--version"), cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"transformer {transformer.__version__} (commit {transformer.commit()})"
    assert "Hydra" not in r.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, no outputs/


def test_build_py_puts_conf_and_the_commit_into_the_wheel(tmp_path):
    """setup.py's build_py, as python -m build runs it for a wheel: every conf/**/*.yaml under transformer/conf/."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    package = tmp_path / "lib" / "transformer"
    want = sorted(str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*.yaml"))
    assert sorted(str(p.relative_to(package / "conf")) for p in (package / "conf").rglob("*.yaml")) == want
    assert "experiment/copy.yaml" in want and "hydra/launcher/slurm.yaml" in want
    assert (package / "_commit.txt").read_text().strip() == transformer.commit()
    assert conf_dir(package) == package / "conf"


def write_mine(folder: Path, text: str = MINE) -> Path:
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "mine.yaml").write_text(text)
    return folder


def test_config_dir_adds_a_users_recipe(tmp_path):
    """`--config-dir DIR experiment=mine` composes DIR/experiment/mine.yaml on top of the package's groups."""
    mine = write_mine(tmp_path / "recipes")
    r = subprocess.run(train_cmd("--config-dir", str(mine), "experiment=mine", "--cfg", "job"), cwd=tmp_path,
                       env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "d_model: 48" in r.stdout and "max_steps: 7" in r.stdout and "name: copy" in r.stdout


def test_config_dir_composes_in_the_precheck(tmp_path):
    """The checks before Hydra runs see the user's folder too: a good recipe passes, a misspelt key in it is one
    `error:` line and exit 2 before any run directory is made, and a missing folder is named."""
    from transformer.cli import compose
    from transformer.cli import train as train_cli

    train_cli.register_configs()
    run = f"hydra.run.dir={tmp_path / 'run'}"
    good = write_mine(tmp_path / "good")
    assert compose.precheck(["--config-dir", str(good), "experiment=mine", run], train_cli.check) == 0
    bad = write_mine(tmp_path / "bad", MINE.replace("max_steps", "max_stepz"))
    assert compose.precheck(["--config-dir", str(bad), "experiment=mine", run], train_cli.check) == 2
    assert compose.precheck(["--config-dir", str(tmp_path / "nowhere"), run], train_cli.check) == 2
    assert not (tmp_path / "run").exists()


def test_config_dir_errors_are_one_line(tmp_path, capfd):
    """The first as a process, the second through transformer-train's main() in this process."""
    from tests.helpers.inprocess import call_main
    from transformer.cli import train as train_cli

    bad = write_mine(tmp_path / "bad", MINE.replace("max_steps", "max_stepz"))
    for args, fragment in ((["--config-dir", str(bad), "experiment=mine"], "trainer.max_stepz"),
                           (["--config-dir", str(tmp_path / "nowhere")], "--config-dir")):
        if fragment == "--config-dir":
            r = call_main(train_cli.main, args, tmp_path, prog="transformer-train", capture=capfd)
        else:
            r = subprocess.run(train_cmd(*args), cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                               timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], \
            r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def make_dry(target: str, venv: Path) -> str:
    r = subprocess.run(["make", "-n", "-C", str(REPO), target, f"VENV={venv}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_train_installs_the_runtime_only_and_make_test_adds_the_test_extra(tmp_path):
    venv = tmp_path / "venv"
    plan = make_dry("train", venv)
    assert "-m venv" in plan and "-e ." in plan and "[test]" not in plan and "[dev]" not in plan
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".runtime").touch()  # `make train` has run
    assert "pip install" not in make_dry("train", venv)
    plan = make_dry("test", venv)
    assert "-m venv" not in plan and "-e '.[test]'" in plan and "pytest" in plan
    (venv / ".installed").touch()  # then `make test`: it stamps both
    assert "pip install" not in make_dry("train", venv) + make_dry("test", venv)
    (venv / ".runtime").unlink()  # a venv the previous Makefile made: .installed only
    assert "pip install -q --no-compile -c constraints-cpu.txt -e .\n" in make_dry("train", venv)


def test_wheel_tier_script_parses_and_helps():
    assert subprocess.run(["bash", "-n", str(WHEEL_TIER)], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(WHEEL_TIER), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "Usage: launch/ci/run-wheel-tier.sh" in r.stdout and "set -euo" not in r.stdout
