"""Distributed training of the encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017)."""
from pathlib import Path
from typing import Optional

__version__ = "0.1.0"


def commit(package: Optional[Path] = None) -> str:
    """The commit this code is from: the one a wheel recorded at build time (setup.py writes _commit.txt), else
    git's, in a clone (an editable install), with -dirty for uncommitted changes to tracked files; else unknown."""
    package = package or Path(__file__).resolve().parent
    recorded = package / "_commit.txt"
    if recorded.is_file():
        return recorded.read_text(encoding="utf-8").strip() or "unknown"
    if not (package.parent / ".git").exists():
        return "unknown"
    import subprocess  # only here: every worker imports this package

    git = ["git", "-C", str(package.parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def version_line() -> str:
    """`transformer-train --version`: e.g. "transformer 0.1.0 (commit abc1234)"."""
    return f"transformer {__version__} (commit {commit()})"
