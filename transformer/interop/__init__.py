"""Models leaving and entering the project: Hugging Face `MarianMTModel` directories and CTranslate2 models.

The weight-name correspondence lives in one place, `names.py`, written against the key names of
`Transformer.state_dict()`.
"""
from transformer.checkpoint_files import CheckpointError


class InteropError(CheckpointError):
    """A model the target format cannot hold, or a directory this project cannot import: one line."""


def replace_dir(tmp, out) -> None:
    """Moves the finished folder `tmp` to `out` (absent or an empty folder) in one rename, so `out` is never
    seen half-written."""
    import os

    from transformer.atomic import fsync_dir
    os.replace(tmp, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))


def check_out_dir(out) -> None:
    """--out must be a new or empty folder in an existing one: an export never mixes with older files."""
    from pathlib import Path
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"--out {out}: exists and is not an empty folder")
    if not out.absolute().parent.is_dir():
        raise InteropError(f"--out {out}: folder {out.absolute().parent} does not exist")
