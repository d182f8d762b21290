"""Shared helpers of the data tests (imported as `from tests.helpers.data import ...`; tests/ is on sys.path)."""
import gzip
import hashlib
import http.server
import os
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from transformer.data.config import DataConfig, TokenizerConfig

# The Multi30k task-1 raw .gz files: $MULTI30K_DIR, else ../shared/data/multi30k beside the repository clone
# (where CI has them). Tests needing them are skipped, with this path in the reason, where they are absent.
MULTI30K = Path(os.environ.get("MULTI30K_DIR") or Path(__file__).resolve().parents[3] / "shared/data/multi30k")
needs_multi30k = pytest.mark.skipif(not (MULTI30K / "train.de.gz").exists(), reason=f"no Multi30k files in {MULTI30K}")

TRAIN_DE = [
    "Ein Mann fährt Fahrrad.", "Eine Frau liest ein Buch.", "Ein Hund läuft im Park.",
    "Zwei Kinder spielen im Park.", "Ein Mann liest ein Buch im Park.", "Eine Frau fährt Fahrrad.",
    "Ein Hund und eine Katze spielen.", "Zwei Männer spielen Fußball.",
]
TRAIN_EN = [
    "A man rides a bike.", "A woman reads a book.", "A dog runs in the park.",
    "Two children play in the park.", "A man reads a book in the park.", "A woman rides a bike.",
    "A dog and a cat play.", "Two men play soccer.",
]
VAL_DE = ["Ein Hund liest ein Buch.", "Zwei Frauen spielen."]
VAL_EN = ["A dog reads a book.", "Two women play."]


def data_cfg(tmp_path: Path, name: str = "files", tokenizer: str = "spacy", seed: int = 1, **data) -> "OmegaConf":
    """The `data`, `tokenizer` and `seed` keys of the full config, with root/cache under tmp_path."""
    tok = data.pop("tok", {})
    d = DataConfig(name=name, root=str(tmp_path / "root"), **data)
    return OmegaConf.create({"data": OmegaConf.structured(d),
                             "tokenizer": OmegaConf.structured(TokenizerConfig(name=tokenizer, **tok)), "seed": seed})


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    data = "".join(f"{ln}\n" for ln in lines).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data, mtime=0))
    else:
        path.write_bytes(data)
    return path


def write_corpus(folder: Path, prefix: str, src: Sequence[str], tgt: Sequence[str], src_lang: str = "de",
                 tgt_lang: str = "en", gz: bool = False) -> str:
    """Writes folder/prefix.{src_lang,tgt_lang}[.gz]; returns the path prefix for data.files."""
    ext = ".gz" if gz else ""
    write_lines(folder / f"{prefix}.{src_lang}{ext}", src)
    write_lines(folder / f"{prefix}.{tgt_lang}{ext}", tgt)
    return str(folder / prefix)


def small_files_cfg(tmp_path: Path, tokenizer: str = "spacy", **data):
    corpus = tmp_path / "corpus"
    files = {"train": write_corpus(corpus, "train", TRAIN_DE, TRAIN_EN),
             "val": write_corpus(corpus, "val", VAL_DE, VAL_EN)}
    data.setdefault("tok", {"min_freq": 1, "vocab_size": 120})
    return data_cfg(tmp_path, "files", tokenizer, files=files, **data)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class FakeEnv:
    """A `DistEnv` stand-in for one rank of a pretend world: records collectives instead of running them."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    from_rank0: object | None = None  # what broadcast_object returns on ranks > 0
    events: list[str] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        self.events.append("barrier")

    def broadcast_object(self, obj):
        self.events.append("broadcast")
        return obj if self.rank == 0 else self.from_rank0


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.server.requests.append(self.path)
        if self.server.fail_first > 0:
            self.server.fail_first -= 1
            self.send_error(503, "try again")
            return
        super().do_GET()


@contextmanager
def serve(folder: Path, fail_first: int = 0):
    """An HTTP server on 127.0.0.1 (a free port) serving `folder`; yields (base url, list of request paths)."""
    def handler(*args, **kwargs):
        return _Handler(*args, directory=str(folder), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requests, server.fail_first = [], fail_first
    with _running(server):
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests


@contextmanager
def _running(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """GET with `Range: bytes=N-` support (206), and connections cut after `cut[path]` bytes, once per path."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.requests.append((self.path, self.headers.get("Range")))
        path = Path(self.server.folder) / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404, "not found")
            return
        data = path.read_bytes()
        start = 0
        if self.headers.get("Range", "").startswith("bytes="):
            start = int(self.headers["Range"][6:].split("-")[0])
            if start >= len(data):
                self.send_error(416, "range not satisfiable")
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        cut = self.server.cut.pop(self.path, None)
        self.wfile.write(data[start:cut])  # a cut sends less than announced, then closes: an interruption
        self.wfile.flush()
        if cut is not None:
            self.close_connection = True


@contextmanager
def serve_ranges(folder: Path, cut: dict | None = None):
    """Like `serve`, for resumable downloads: yields (base url, list of (path, Range header))."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    server.folder, server.cut, server.requests = str(folder), dict(cut or {}), []
    with _running(server):
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests
