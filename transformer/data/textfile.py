"""The one reader of text files: sources for transformer-translate and transformer-evaluate, references, and
the corpora of training and transformer-preprocess, all read by the same rules.

- UTF-8, one sentence per line. A line ends at "\\n" only, and one "\\r" before it is dropped (CRLF reads as
  LF): `str.splitlines` would also split on U+2028, U+0085 and friends, which occur in web-crawled text and
  would shift the alignment with the other side.
- A byte-order mark at the start of the file is dropped; elsewhere U+FEFF is text.
- A last line without "\\n" is a line; the final "\\n" does not start an empty one.
- Invalid UTF-8 is an error naming the file, the line and the byte, never replaced: a file in another
  encoding would otherwise be translated, scored or trained on as garbage without a word.
- Blank lines (nothing but whitespace) are kept, so line k of any output answers line k of the input.
  translate and evaluate give them an empty translation without running the model (the same line either
  way, so `transformer-evaluate --src X --ref Y` scores what `transformer-translate --input X | sacrebleu Y`
  does); training skips blank pairs (`data.bad_pairs`).
- gzip: a name ending in .gz, or a stream starting with gzip's magic bytes (`cat x.gz |`), is decompressed.
- Any readable path: a regular file, a named pipe, /dev/stdin, a process substitution (`<(zcat x.gz)`). A
  missing path is "no such file", a folder its own error. A file read more than once (a training corpus)
  must be a regular file: a pipe would be empty the second time.
"""
import contextlib
import gzip
import os
import stat
import zlib
from typing import BinaryIO, Iterator, List, Optional, Union

_BLOCK = 1 << 20  # bytes read at a time (at most: a pipe or terminal gives what it has)
_GZIP_MAGIC = b"\x1f\x8b"  # never the start of UTF-8 text: 0x8b is a continuation byte

Source = Union[str, os.PathLike, BinaryIO]


def kind(path: Union[str, os.PathLike]) -> str:
    """What `path` is, following links: file, folder, pipe, character device, socket, block device or missing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:  # a/b where a is a file
        return "missing"
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "pipe"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISSOCK, "socket"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def check_readable(path: Union[str, os.PathLike], label: str) -> None:
    """A path to read once: anything but a missing path or a folder. `label` starts the error
    (e.g. "--src test.de")."""
    k = kind(path)
    if k == "missing":
        raise ValueError(f"{label}: no such file")
    if k == "folder":
        raise ValueError(f"{label}: is a folder, not a file")


def check_rereadable(path: Union[str, os.PathLike], label: str, reads: str) -> None:
    """A path read more than once (`reads` says when) must be a regular file."""
    k = kind(path)
    if k not in ("file", "missing", "folder"):
        raise ValueError(f"{label}: {path} is a {k}, which can be read only once, and {reads}: "
                         "write it to a file first")


@contextlib.contextmanager
def open_bytes(source: Source) -> Iterator[BinaryIO]:
    """The bytes of `source` (a path, opened and closed here, or an open binary stream, left open),
    decompressed if gzip (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        is_path = isinstance(source, (str, os.PathLike))
        f = stack.enter_context(open(source, "rb")) if is_path else source
        peek = getattr(f, "peek", None)  # a stand-in for stdin may have none
        if (is_path and str(source).endswith(".gz")) or (peek is not None and peek(2)[:2] == _GZIP_MAGIC):
            f = stack.enter_context(gzip.GzipFile(fileobj=f, mode="rb"))
        yield f


def _split(data: bytes, name: str, newlines_before: int, bytes_before: int) -> List[str]:
    """Lines of `data`, a run of complete lines (or the input's unterminated last line)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = newlines_before + data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{name}, line {line}: invalid UTF-8 ({e.reason} at byte {bytes_before + e.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    if "\r" in text:
        lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
    return lines


def iter_lines(source: Source, chunk_lines: int = 10000, name: Optional[str] = None,
               empty_ok: bool = False) -> Iterator[List[str]]:
    """Lists of `chunk_lines` lines (the last may be shorter) of `source` (a path or an open binary stream),
    without line ends. A chunk is given as soon as its lines have arrived, so a terminal or a pipe is
    answered line by line with `chunk_lines=1`. Errors are `ValueError`s starting with `name` (default: the
    path). Unless `empty_ok`, an input without any non-blank character raises "file is empty" once read through."""
    name = str(source) if name is None else name
    newlines = nbytes = 0
    rest, buf, first, blank = b"", [], True, True
    try:
        with open_bytes(source) as f:
            while True:
                block = f.read1(_BLOCK)  # read1: what has arrived, without waiting for a full block
                data = rest + block
                if block:
                    cut = data.rfind(b"\n") + 1
                    data, rest = data[:cut], data[cut:]
                    if not data:
                        continue
                elif not data:
                    break
                lines = _split(data, name, newlines, nbytes)
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
        raise ValueError(f"{name}: cannot read: {e}") from None
    if blank and not empty_ok:
        raise ValueError(f"{name}: file is empty")
    if buf:
        yield buf


def read_lines(source: Source, name: Optional[str] = None) -> List[str]:
    """All lines of `source` (see `iter_lines`): for test sets and other small files."""
    return [ln for chunk in iter_lines(source, 1 << 16, name) for ln in chunk]


def count_lines(path: Union[str, os.PathLike]) -> int:
    """Reads `path` through, checking it as `iter_lines` does, and counts its lines."""
    return sum(len(chunk) for chunk in iter_lines(path, 1 << 16))

