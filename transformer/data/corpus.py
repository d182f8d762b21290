"""Reading parallel text: one sentence per line, PREFIX.SRC_LANG aligned line by line with PREFIX.TGT_LANG.

Files are read as a stream of line chunks, so memory is set by the chunk size, never by the corpus.
Every malformed input raises one `ValueError` naming the file (and the line where there is one).
Lines are split on "\\n" only (a trailing "\\r" is dropped): `str.splitlines` would also split on
U+2028, U+0085 and friends, which occur in web-crawled text and would shift the alignment.
"""
import gzip
import hashlib
import zlib
from pathlib import Path
from typing import Iterator, List, Tuple

_BLOCK = 1 << 20  # bytes read at a time


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


def _split(data: bytes, path: Path, newlines_before: int, bytes_before: int) -> List[str]:
    """Lines of `data`, a run of complete lines (or the file's unterminated last line)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = newlines_before + data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}, line {line}: invalid UTF-8 ({e.reason} at byte {bytes_before + e.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    if "\r" in text:
        lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
    return lines


def iter_lines(path: Path, chunk_lines: int = 10000) -> Iterator[List[str]]:
    """Lists of `chunk_lines` lines (the last may be shorter) of a UTF-8 text file, gzip if it ends in .gz,
    without line ends. A file without any non-blank character raises "file is empty" once read through."""
    path = Path(path)
    newlines = nbytes = 0
    rest, buf, first, blank = b"", [], True, True
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            while True:
                block = f.read(_BLOCK)
                data = rest + block
                if block:
                    cut = data.rfind(b"\n") + 1
                    data, rest = data[:cut], data[cut:]
                    if not data:
                        continue
                elif not data:
                    break
                lines = _split(data, path, newlines, nbytes)
                if first and lines and lines[0].startswith("\ufeff"):
                    lines[0] = lines[0][1:]  # a byte-order mark is not part of the first sentence
                first = False
                if blank and any(ln.strip() for ln in lines):
                    blank = False
                newlines, nbytes = newlines + data.count(b"\n"), nbytes + len(data)
                i = 0
                while i < len(lines):
                    take = chunk_lines - len(buf)
                    buf.extend(lines[i:i + take])
                    i += take
                    if len(buf) == chunk_lines:
                        yield buf
                        buf = []
                if not block:
                    break
    except (OSError, EOFError, zlib.error) as e:  # includes gzip.BadGzipFile and a truncated .gz
        raise ValueError(f"{path}: cannot read: {e}") from None
    if blank:
        raise ValueError(f"{path}: file is empty")
    if buf:
        yield buf


def read_lines(path: Path) -> List[str]:
    """All lines of a file (see `iter_lines`): for test sets and other small files."""
    return [ln for chunk in iter_lines(path, 1 << 16) for ln in chunk]


def count_lines(path: Path) -> int:
    """Reads `path` through, checking it as `iter_lines` does, and counts its lines."""
    return sum(len(chunk) for chunk in iter_lines(path, 1 << 16))


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
