"""The lint tier, in the fast tests: shellcheck on every shell script, hadolint on docker/Dockerfile, ruff
(rules in pyproject.toml) on the package, the tests and the benchmarks. The dev extra installs all three
next to this interpreter."""
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import SHELLCHECK

REPO = Path(__file__).resolve().parents[1]
# Folders that hold no sources of ours (environments, outputs, caches).
SKIP = {".git", ".venv", ".venv-floor", "venv", "outputs", "multirun", "build", "dist", ".pytest_cache", ".ruff_cache",
        "__pycache__", "data", "shared"}


def tool(name: str):
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def shell_scripts():
    """Every *.sh and *.sbatch file, and every file whose first line is a bash or sh shebang."""
    found = []
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if not path.is_file() or SKIP.intersection(rel.parts):
            continue
        if path.suffix in (".sh", ".sbatch"):
            found.append(path)
            continue
        try:
            with path.open("rb") as f:
                first = f.readline(100)
        except OSError:
            continue
        if first.startswith(b"#!") and (first.rstrip().endswith((b"bash", b"/sh"))):
            found.append(path)
    return found


def test_finds_the_scripts():
    names = {str(p.relative_to(REPO)) for p in shell_scripts()}
    assert {".ci/run", "launch/slurm.sbatch", "launch/common.sh", "launch/ci/run-slurm-tier.sh",
            "launch/ci/tier-lib.sh", "docker/ci/run-docker-tier.sh"} <= names, names


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install -e '.[dev]')")
def test_shellcheck_every_script():
    scripts = [str(p.relative_to(REPO)) for p in shell_scripts()]
    res = subprocess.run([SHELLCHECK, "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-6000:]


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint not installed (pip install -e '.[dev]')")
def test_hadolint_dockerfile():
    res = subprocess.run([tool("hadolint"), "--no-color", "docker/Dockerfile"], cwd=REPO, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(tool("ruff") is None, reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff():
    res = subprocess.run([tool("ruff"), "check", "--no-cache", "--output-format", "concise",
                          "transformer", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr


@functools.cache
def heading_anchors(doc: Path) -> frozenset:
    """GitHub's anchors for the Markdown headings of a file outside code fences: lower case, punctuation dropped,
    spaces to hyphens. Cached: the README links to docs/multi30k.md dozens of times."""
    anchors, fenced = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return frozenset(anchors)


def broken_links(doc: Path) -> list:
    """Relative links of a Markdown file whose file or heading anchor does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(target)
    return broken


def test_readme_and_docs_links_resolve(tmp_path):
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/benchmarks/ too
    assert len(docs) > 1
    assert {str(d.relative_to(REPO)): broken_links(d) for d in docs} == {str(d.relative_to(REPO)): [] for d in docs}
    # The check itself finds a missing heading and a missing file.
    bad = tmp_path / "bad.md"
    bad.write_text("# Title\n\n[ok](#title) [no heading](#nowhere) [no file](missing.md) [fenced](#not-a-heading)\n"
                   "```\n# not a heading\n```\n")
    assert broken_links(bad) == ["#nowhere", "missing.md", "#not-a-heading"]
