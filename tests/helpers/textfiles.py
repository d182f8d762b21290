"""Odd text files (a byte-order mark, CRLF, blank lines, no final newline, an invalid byte) and named pipes
fed by a writer thread, for the tests of the one text reader (transformer/data/textfile.py) and its commands."""
import contextlib
import os
import threading
from pathlib import Path

# Copy-task sentences (symbols 4..11) with every oddity the reader has a rule for.
ODD = b"\xef\xbb\xbf4 5 6\r\n7 8\r\n\r\n \t\n9 10 11 4\r\n5 5"
ODD_LINES = ["4 5 6", "7 8", "", " \t", "9 10 11 4", "5 5"]
BAD = ODD.replace(b"9 10 11", b"9 \xff 11")  # an invalid byte in line 5
BAD_BYTE = BAD.index(b"\xff")


@contextlib.contextmanager
def fifo(path: Path, data: bytes, again: bool = False):
    """A named pipe at `path` that a writer thread fills with `data` once the reader opens it; with `again`,
    for every reader that opens it until the block ends (a pipe that could be read twice). A writer still
    waiting at the end is released by opening the pipe here."""
    os.mkfifo(path)
    stop = threading.Event()

    def write():
        while not stop.is_set():
            try:
                with open(path, "wb") as f:  # blocks until a reader opens the pipe
                    if not stop.is_set():
                        f.write(data)
            except BrokenPipeError:  # the reader stopped early
                pass
            if not again:
                return

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        stop.set()
        while writer.is_alive():
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            writer.join(timeout=1)
            os.close(fd)
