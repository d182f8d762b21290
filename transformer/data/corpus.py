"""Reading parallel text: one sentence per line, PREFIX.SRC_LANG aligned line by line with PREFIX.TGT_LANG.

Every malformed input raises one `ValueError` naming the file (and the line where there is one).
Lines are split on "\\n" only (a trailing "\\r" is dropped): `str.splitlines` would also split on
U+2028, U+0085 and friends, which occur in web-crawled text and would shift the alignment.
"""
import gzip
import hashlib
from pathlib import Path
from typing import List, Tuple


def resolve(prefix: str, lang: str) -> Path:
    """PREFIX.LANG, or PREFIX.LANG.gz; exactly one of them must exist."""
    plain = Path(f"{prefix}.{lang}").expanduser()
    gz = Path(f"{plain}.gz")
    if plain.exists() and gz.exists():
        raise ValueError(f"both {plain} and {gz} exist: remove one so it is clear which is the corpus")
    if plain.exists():
        return plain
    if gz.exists():
        return gz
    raise ValueError(f"corpus file not found: {plain} (nor {gz.name})")


def read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None


def read_lines(path: Path) -> List[str]:
    """The lines of a UTF-8 text file (gzip if it ends in .gz), without line ends. Empty file -> error."""
    raw = read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}, line {line}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark is not part of the first sentence
    if not text.strip():
        raise ValueError(f"{path}: file is empty")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def read_parallel(src_path: Path, tgt_path: Path) -> Tuple[List[str], List[str]]:
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                         f"line {min(len(src), len(tgt)) + 1} has no partner; the files must be aligned line by line")
    return src, tgt


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes as stored: the identity of a corpus in the preprocessing cache key."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
