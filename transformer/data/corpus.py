"""Reading parallel text: one sentence per line, PREFIX.SRC_LANG aligned line by line with PREFIX.TGT_LANG.

Files are read as a stream of line chunks, so memory is set by the chunk size, never by the corpus, and
by the rules of transformer/data/textfile.py (line ends, byte-order mark, invalid UTF-8, gzip). Every
malformed input raises one `ValueError` naming the file (and the line where there is one).
"""
import hashlib
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from transformer.data.textfile import check_rereadable, count_lines, iter_lines, kind, read_lines

__all__ = ["count_lines", "count_pairs", "file_digest", "iter_lines", "iter_pairs", "read_lines", "read_parallel",
           "resolve"]

# Why the train and valid corpora must be regular files (transformer/data/translation.py, preprocess.py).
READ_TWICE = ("this corpus is read several times (its sha256 for the cache key, a check and line count, the "
              "tokenizer's sample, the encoding)")


def resolve(prefix: str, lang: str, key: Optional[str] = None, read_once: bool = False) -> Path:
    """PREFIX.LANG, or PREFIX.LANG.gz; exactly one of them must exist, and not be a folder. Unless `read_once`
    (a test set), a regular file, not a pipe. `key` (e.g. "data.files.train=corpus/train") starts those errors."""
    plain = Path(f"{prefix}.{lang}").expanduser()
    gz = Path(f"{plain}.gz")
    if plain.exists() and gz.exists():
        raise ValueError(f"both {plain} and {gz} exist: remove one so it is clear which is the corpus")
    if not plain.exists() and not gz.exists():
        raise ValueError(f"corpus file not found: {plain} (nor {gz.name})")
    path = plain if plain.exists() else gz
    label = f"{key}: {path}" if key else str(path)
    if kind(path) == "folder":
        raise ValueError(f"{label} is a folder, not a file")
    if not read_once:
        check_rereadable(path, key or str(path), READ_TWICE)
    return path


def _mismatch(src_path: Path, n_src: int, tgt_path: Path, n_tgt: int) -> ValueError:
    return ValueError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: line {min(n_src, n_tgt) + 1} "
                      "has no partner; the files must be aligned line by line")


def count_pairs(src_path: Path, tgt_path: Path) -> int:
    """Checks both files (see `iter_lines`) and that they align; returns the number of pairs."""
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise _mismatch(src_path, n_src, tgt_path, n_tgt)
    return n_src


def iter_pairs(src_path: Path, tgt_path: Path, chunk: int) -> Iterator[Tuple[List[str], List[str]]]:
    """(source lines, target lines) chunks of `chunk` aligned pairs, in file order."""
    for s, t in zip(iter_lines(src_path, chunk), iter_lines(tgt_path, chunk), strict=False):
        if len(s) != len(t):  # only where the files changed since count_pairs checked them
            raise _mismatch(src_path, count_lines(src_path), tgt_path, count_lines(tgt_path))
        yield s, t


def read_parallel(src_path: Path, tgt_path: Path) -> Tuple[List[str], List[str]]:
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise _mismatch(src_path, len(src), tgt_path, len(tgt))
    return src, tgt


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes as stored: the identity of a corpus in the preprocessing cache key."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
