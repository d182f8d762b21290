"""Checksummed, atomic downloads of the Multi30k task-1 raw files (Elliott et al., 2016).

A file is only ever visible under its final name once its sha256 matches the table below: bytes
stream into a temporary file in the same folder, which is fsynced and `os.replace`d into place.
A folder that already holds verified files is used without any network access.
"""
import hashlib
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, Optional

from transformer.atomic import atomic_open

log = logging.getLogger(__name__)

# sha256 of the byte-identical files of github.com/multi30k/dataset, data/task1/raw.
MULTI30K_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2018_flickr.de.gz": "ddd0130c7d97482dc5197a02141dae8dd79f20f03586c480d675c09a32daf608",
    "test_2018_flickr.en.gz": "ef4f4844037d4c5dea75c9a8ed5fd78905967a26f67c255e230cc9780032654d",
}
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco", "test_2018_flickr")
MULTI30K_LANGS = ("de", "en")
_CHUNK = 1 << 16


class DownloadError(OSError):
    """The network could not deliver a file (after retries), or delivered the wrong bytes."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def default_root() -> Path:
    """$XDG_CACHE_HOME/transformer, else ~/.cache/transformer."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformer"


def data_root(root: Optional[str]) -> Path:
    return Path(root).expanduser() if root else default_root()


def multi30k_file(split: str, lang: str) -> str:
    return f"{split}.{lang}.gz"


def verify(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ValueError(f"{path}: sha256 is {got}, expected {expected} (a corrupt or foreign file): "
                         "delete it to download it again")


def fetch(url: str, dest: Path, sha256: str, *, retries: int = 4, timeout_s: float = 60.0,
          backoff_s: float = 1.0, progress: bool = True) -> Path:
    """Downloads `url` to `dest`, which appears only if its sha256 is `sha256`.

    Network failures are retried `retries` times in all, waiting backoff_s * 2**k in between; a
    404 or a checksum mismatch is not retried (it would fail the same way again)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    last: Optional[BaseException] = None
    for attempt in range(max(1, retries)):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            _fetch_once(url, dest, sha256, timeout_s, progress)
            return dest
        except DownloadError:  # wrong bytes: fetching again would give the same
            raise
        except urllib.error.HTTPError as e:
            last = e
            if e.code in (401, 403, 404, 410):
                break
        except (urllib.error.URLError, OSError, TimeoutError) as e:  # refused, reset, DNS, timeout
            last = e
        log.warning("download of %s failed (attempt %d/%d): %s", url, attempt + 1, retries, last)
    raise DownloadError(f"could not download {url}: {last}. To run offline, put the file at {dest} "
                        "(or point data.root at a folder holding the Multi30k files)")


def _fetch_once(url: str, dest: Path, sha256: str, timeout_s: float, progress: bool) -> None:
    from tqdm import tqdm

    h = hashlib.sha256()
    # The bytes stream into DEST's temporary twin, renamed to DEST only once the checksum has matched.
    with atomic_open(dest, "wb", suffix=".part") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
        total = resp.headers.get("Content-Length")
        with tqdm(total=int(total) if total else None, unit="B", unit_scale=True, desc=dest.name,
                  disable=not progress, leave=False) as bar:
            for chunk in iter(lambda: resp.read(_CHUNK), b""):
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
        if h.hexdigest() != sha256:
            raise DownloadError(f"{url}: sha256 is {h.hexdigest()}, expected {sha256}; nothing was written to {dest}")


def ensure_multi30k(root: Path, splits: Iterable[str], langs: Iterable[str], url: str, *, retries: int = 4,
                    timeout_s: float = 60.0, backoff_s: float = 1.0, progress: bool = True,
                    checksums: Optional[Dict[str, str]] = None) -> Dict[str, Path]:
    """Paths of `{split}.{lang}.gz` under ROOT/multi30k, downloading (and verifying) what is missing.

    Files already there are verified by hash only: no network call is made when all are present."""
    table = MULTI30K_SHA256 if checksums is None else checksums
    # ROOT may itself be the folder of .gz files (a shared dataset copy) or the cache that holds multi30k/.
    folder = root if any((root / name).is_file() for name in table) else root / "multi30k"
    out = {}
    for split in splits:
        for lang in langs:
            name = multi30k_file(split, lang)
            if name not in table:
                known = sorted({n.rsplit(".", 2)[0] for n in table})
                raise ValueError(f"Multi30k has no file {name} (splits: {', '.join(known)}; languages: de, en)")
            path = folder / name
            if path.exists():
                verify(path, table[name])
            else:
                log.info("downloading %s/%s to %s", url.rstrip("/"), name, path)
                fetch(f"{url.rstrip('/')}/{name}", path, table[name], retries=retries, timeout_s=timeout_s,
                      backoff_s=backoff_s, progress=progress)
            out[name] = path
    return out
