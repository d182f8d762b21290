"""Multi30k download: checksums, atomic writes, retries, offline use (loopback HTTP server only)."""
import gzip
import shutil
import socket
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from tests.helpers.data import MULTI30K, FakeEnv, data_cfg, needs_multi30k, serve, sha256_bytes
from transformer.data import download
from transformer.data.download import DownloadError, ensure_multi30k


def _synthetic_multi30k(folder, n_train=6):
    """Small gzipped {train,val}.{de,en}.gz files and their checksum table."""
    texts = {
        "train.de.gz": [f"Ein Hund Nummer {i} läuft ." for i in range(n_train)],
        "train.en.gz": [f"A dog number {i} runs ." for i in range(n_train)],
        "val.de.gz": ["Ein Hund läuft .", "Ein Hund Nummer läuft ."],
        "val.en.gz": ["A dog runs .", "A dog number runs ."],
    }
    folder.mkdir(parents=True, exist_ok=True)
    table = {}
    for name, lines in texts.items():
        data = gzip.compress("".join(f"{ln}\n" for ln in lines).encode(), mtime=0)
        (folder / name).write_bytes(data)
        table[name] = sha256_bytes(data)
    return table


def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_download_happy_path(tmp_path):
    table = _synthetic_multi30k(tmp_path / "server")
    root = tmp_path / "root"
    with serve(tmp_path / "server") as (url, requests):
        paths = ensure_multi30k(root, ["train", "val"], ["de", "en"], url, checksums=table, progress=False)
    assert sorted(paths) == sorted(table)
    for name, path in paths.items():
        assert path == root / "multi30k" / name
        assert path.read_bytes() == (tmp_path / "server" / name).read_bytes()
    assert sorted(requests) == sorted(f"/{n}" for n in table)
    assert _leftovers(root / "multi30k") == []


def test_bad_checksum_leaves_no_file(tmp_path):
    table = _synthetic_multi30k(tmp_path / "server")
    table["train.de.gz"] = "0" * 64
    root = tmp_path / "root"
    with serve(tmp_path / "server") as (url, requests):
        with pytest.raises(DownloadError, match="sha256"):
            ensure_multi30k(root, ["train"], ["de"], url, checksums=table, progress=False, backoff_s=0)
    assert not (root / "multi30k").exists()  # neither the file, nor a temporary file, nor the folder made for it
    assert requests == ["/train.de.gz"]  # a wrong checksum is not retried


def test_server_unreachable_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a port nobody listens on once this socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match=rf"could not download http://127.0.0.1:{port}/val.de.gz.*offline"):
        ensure_multi30k(tmp_path, ["val"], ["de"], f"http://127.0.0.1:{port}", retries=2, backoff_s=0,
                        timeout_s=5, progress=False)
    assert not (tmp_path / "multi30k").exists()


def test_retries_after_server_error(tmp_path):
    table = _synthetic_multi30k(tmp_path / "server")
    with serve(tmp_path / "server", fail_first=2) as (url, requests):
        paths = ensure_multi30k(tmp_path / "root", ["val"], ["en"], url, checksums=table, retries=3, backoff_s=0,
                                progress=False)
    assert paths["val.en.gz"].read_bytes() == (tmp_path / "server" / "val.en.gz").read_bytes()
    assert requests == ["/val.en.gz"] * 3


def test_missing_file_on_server_is_not_retried(tmp_path):
    table = _synthetic_multi30k(tmp_path / "server")
    (tmp_path / "server" / "val.en.gz").unlink()
    with serve(tmp_path / "server") as (url, requests):
        with pytest.raises(DownloadError, match="404"):
            ensure_multi30k(tmp_path / "root", ["val"], ["en"], url, checksums=table, retries=3, backoff_s=0,
                            progress=False)
    assert requests == ["/val.en.gz"]


def test_unknown_split_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="no file test_2099.de.gz.*test_2016_flickr"):
        ensure_multi30k(tmp_path, ["test_2099"], ["de"], "http://127.0.0.1:9")


def test_checksum_table_covers_every_split():
    for split in download.MULTI30K_SPLITS:
        for lang in download.MULTI30K_LANGS:
            assert len(download.MULTI30K_SHA256[f"{split}.{lang}.gz"]) == 64


def test_offline_folder_makes_no_network_call(tmp_path, monkeypatch):
    table = _synthetic_multi30k(tmp_path / "root" / "multi30k")
    _no_network(monkeypatch)
    paths = ensure_multi30k(tmp_path / "root", ["train", "val"], ["de", "en"], "http://127.0.0.1:9", checksums=table)
    assert len(paths) == 4


def test_corrupt_local_file_is_reported_not_downloaded(tmp_path, monkeypatch):
    table = _synthetic_multi30k(tmp_path / "root" / "multi30k")
    (tmp_path / "root" / "multi30k" / "val.de.gz").write_bytes(b"truncated")
    _no_network(monkeypatch)
    with pytest.raises(ValueError, match=r"val.de.gz: sha256 is .* delete it"):
        ensure_multi30k(tmp_path / "root", ["val"], ["de"], "http://127.0.0.1:9", checksums=table)


@needs_multi30k
def test_real_multi30k_folder_is_used_offline(tmp_path, monkeypatch):
    folder = tmp_path / "root" / "multi30k"
    folder.mkdir(parents=True)
    for f in MULTI30K.glob("*.gz"):
        (folder / f.name).symlink_to(f)
    _no_network(monkeypatch)
    paths = ensure_multi30k(tmp_path / "root", ["train", "val", "test_2016_flickr"], ["de", "en"], "http://127.0.0.1:9")
    assert len(paths) == 6


def test_default_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert download.data_root(None) == tmp_path / "transformer"
    assert download.data_root("~/x") == download.Path("~/x").expanduser()


def test_build_multi30k_downloads_once_then_runs_offline(tmp_path, monkeypatch):
    """End to end: data=multi30k from a loopback mirror, then the same root with the network cut."""
    from transformer.data.translation import build_translation_data
    table = _synthetic_multi30k(tmp_path / "server")
    for name, digest in table.items():
        monkeypatch.setitem(download.MULTI30K_SHA256, name, digest)
    with serve(tmp_path / "server") as (url, requests):
        cfg = data_cfg(tmp_path, "multi30k", url=url, tok={"min_freq": 1})
        dm = build_translation_data(cfg, FakeEnv(), None)
    assert (len(dm.train), len(dm.valid)) == (6, 2)
    assert dm.valid_refs == ["A dog runs .", "A dog number runs ."]
    _no_network(monkeypatch)
    from transformer.data.cache import cache_folder
    shutil.rmtree(cache_folder(cfg.data.cache_dir, tmp_path / "root"))  # the raw files alone must suffice offline
    dm = build_translation_data(cfg, FakeEnv(), None)
    assert len(dm.train) == 6


@contextmanager
def silent_server(send=b"", trickle_s=None):
    """A loopback server that accepts every connection, sends `send`, then nothing more (or, with
    `trickle_s`, one byte every `trickle_s` seconds): the network that drops packets rather than refusing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop, conns = threading.Event(), []

    def talk(conn):
        conn.sendall(send)
        while trickle_s is not None and not stop.wait(trickle_s):
            try:
                conn.sendall(b"x")
            except OSError:
                return

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=talk, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", conns
    finally:
        stop.set()
        server.close()
        for conn in conns:
            conn.close()


def test_a_server_that_never_answers_times_out_each_attempt(tmp_path):
    with silent_server() as (url, conns):
        t0 = time.monotonic()
        with pytest.raises(DownloadError, match=r"could not download .*timed out"):
            ensure_multi30k(tmp_path / "root", ["val"], ["de"], url, retries=3, timeout_s=0.3, backoff_s=0,
                            progress=False)
        elapsed = time.monotonic() - t0
    assert len(conns) == 3  # every attempt connected, and each gave up after its read timeout
    assert 0.8 < elapsed < 10
    assert not (tmp_path / "root").exists()  # no empty multi30k/ (nor root) left behind


def test_the_deadline_bounds_all_attempts_together(tmp_path):
    with silent_server() as (url, conns):
        t0 = time.monotonic()
        with pytest.raises(DownloadError, match="deadline"):
            ensure_multi30k(tmp_path / "root", ["val"], ["de"], url, retries=1000, timeout_s=0.3, deadline_s=1.0,
                            backoff_s=0, progress=False)
        elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 1.0 + 0.3 + 5  # the deadline, give or take one read timeout (and a slow machine)
    assert 2 <= len(conns) < 1000


def test_the_deadline_stops_a_trickle_that_never_trips_the_read_timeout(tmp_path):
    header = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
    with silent_server(send=header, trickle_s=0.05) as (url, conns):
        t0 = time.monotonic()
        with pytest.raises(DownloadError, match="deadline.*kept in .*val.de.gz.part"):
            ensure_multi30k(tmp_path / "root", ["val"], ["de"], url, retries=3, timeout_s=1.0, deadline_s=1.0,
                            backoff_s=0, progress=False)
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 1.0 + 5
    assert len(conns) == 1  # a deadline is not retried
    part = tmp_path / "root" / "multi30k" / ".val.de.gz.part"
    assert 0 < part.stat().st_size < 100000  # what came is kept for the next run to resume


def test_a_read_only_dataset_folder_is_never_downloaded_into(tmp_path, monkeypatch):
    """transformer-evaluate on a --data-root that lacks a split: an error naming the flag, and the folder
    untouched (no .part file, no multi30k/ made inside it)."""
    from transformer.data.translation import load_split
    table = _synthetic_multi30k(tmp_path / "root")  # root holds the files directly: a shared dataset copy
    for name, digest in table.items():
        monkeypatch.setitem(download.MULTI30K_SHA256, name, digest)
    _no_network(monkeypatch)
    before = sorted(p.name for p in (tmp_path / "root").rglob("*"))
    cfg = data_cfg(tmp_path, "multi30k")
    assert load_split(cfg, "val", download=False)[1] == ["A dog runs .", "A dog number runs ."]
    with pytest.raises(FileNotFoundError, match=r"has no test_2017_flickr.de.gz.*point --data-root at"):
        load_split(cfg, "test_2017_flickr", download=False, root_key="--data-root")
    assert sorted(p.name for p in (tmp_path / "root").rglob("*")) == before
