"""Checksummed, atomic, resumable downloads; the Multi30k task-1 raw files (Elliott et al., 2016).

A file is only ever visible under its final name once complete and its checksum matches: bytes stream
into `.NAME.part` in the same folder (kept, so an interrupted download resumes), which is fsynced and
`os.replace`d into place. A folder that already holds verified files is used without any network access.
"""
import hashlib
import http.client
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from transformer.atomic import fsync_dir

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


class DeadlineExceeded(TimeoutError):
    """The whole download (all attempts) took longer than its deadline."""


def make_dirs(folder: Path) -> List[Path]:
    """mkdir -p, returning the folders it made (deepest first), so a failure can take them back."""
    made = []
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    if made:
        made[0].mkdir(parents=True, exist_ok=True)
    return made


def remove_empty(folders: List[Path]) -> None:
    for folder in folders:  # deepest first; stops at the first one that holds something
        try:
            folder.rmdir()
        except OSError:
            return


def fetch(url: str, dest: Path, sha256: Optional[str] = None, *, md5: Optional[str] = None, retries: int = 4,
          timeout_s: float = 60.0, deadline_s: Optional[float] = None, backoff_s: float = 1.0,
          progress: bool = True, root_key: str = "data.root") -> str:
    """Downloads `url` to `dest`, which appears only once complete and, where a checksum is given, matching it.
    Returns the file's sha256.

    Bytes go to `.DEST.part` beside it; an interrupted transfer (a reset, a timeout, a killed process) is
    resumed from there with an HTTP Range request, by the next attempt or the next run. Network failures are
    retried `retries` times in all, waiting backoff_s * 2**k in between; a 404 or a checksum mismatch is not
    retried (it would fail the same way again), and a mismatching file is deleted.

    `timeout_s` bounds connecting and each read; `deadline_s` (None: no bound; the commands pass
    data.download_deadline_s) bounds the whole download, retries included (a server that trickles a byte
    per minute never trips a read timeout), give or take one read timeout.
    Folders made for `dest` are removed again when nothing was received."""
    made = make_dirs(dest.parent)
    part = dest.parent / f".{dest.name}.part"
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    done, last = False, None
    for attempt in range(max(1, retries)):
        if attempt:
            pause = backoff_s * 2 ** (attempt - 1)
            if deadline is not None and time.monotonic() + pause >= deadline:
                last = DeadlineExceeded(f"no time left for attempt {attempt + 1} within the {deadline_s:g} s deadline "
                                        "(data.download_deadline_s)")
                break
            time.sleep(pause)
        try:
            _fetch_once(url, part, timeout_s, progress, deadline)
            done = True
            break
        except urllib.error.HTTPError as e:
            last = e
            if e.code in (401, 403, 404, 410):
                break
        except DeadlineExceeded as e:
            last = e
            break
        except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:  # refused, reset, ...
            last = e
        log.warning("download of %s failed (attempt %d/%d): %s", url, attempt + 1, retries, last)
    if not done:
        if part.exists() and part.stat().st_size == 0:
            part.unlink()
        kept = f"; the {part.stat().st_size} bytes received are kept in {part} and the next run resumes" \
            if part.exists() else ""
        remove_empty(made)
        raise DownloadError(f"could not download {url}: {last}{kept}. To run offline, put the file at {dest} "
                            f"(or point {root_key} at a folder holding the dataset's files)")
    digests = {"sha256": hashlib.sha256(), "md5": hashlib.md5()}
    with open(part, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            for h in digests.values():
                h.update(chunk)
    for name, want in (("sha256", sha256), ("md5", md5)):
        if want is not None and digests[name].hexdigest() != want:
            part.unlink()
            remove_empty(made)
            raise DownloadError(f"{url}: {name} is {digests[name].hexdigest()}, expected {want}; nothing was "
                                f"written to {dest}")
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return digests["sha256"].hexdigest()


def _time_left(deadline: Optional[float], timeout_s: float) -> float:
    """The socket timeout for the next connect or read: `timeout_s`, or less where the deadline is nearer."""
    if deadline is None:
        return timeout_s
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the download deadline (data.download_deadline_s) passed")
    return min(timeout_s, left)


def _fetch_once(url: str, part: Path, timeout_s: float, progress: bool, deadline: Optional[float] = None) -> None:
    """Appends the rest of `url` to `part` (all of it when `part` is absent or the server ignores ranges)."""
    from tqdm import tqdm

    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(request, timeout=_time_left(deadline, timeout_s))
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the part is the whole file
            return
        raise
    with resp:
        resumed = have and resp.status == 206
        length = resp.headers.get("Content-Length")
        total = (have if resumed else 0) + int(length) if length else None
        if have and not resumed:
            log.info("%s: the server does not resume downloads; starting over", url)
        with open(part, "ab" if resumed else "wb") as out, \
                tqdm(total=total, initial=have if resumed else 0, unit="B", unit_scale=True, desc=part.name[1:-5],
                     disable=not progress, leave=False, mininterval=1.0) as bar:
            while True:
                _time_left(deadline, timeout_s)  # a read returns within timeout_s: the deadline overshoots by less
                chunk = resp.read1(_CHUNK)  # one socket read (read() would wait for the whole 64 KiB of a trickle)
                if not chunk:
                    break
                out.write(chunk)
                bar.update(len(chunk))
            out.flush()
            size = out.tell()
    if total is not None and size < total:
        raise ConnectionError(f"connection closed after {size} of {total} bytes")


def ensure_multi30k(root: Path, splits: Iterable[str], langs: Iterable[str], url: str, *, retries: int = 4,
                    timeout_s: float = 60.0, deadline_s: Optional[float] = None, backoff_s: float = 1.0,
                    progress: bool = True, checksums: Optional[Dict[str, str]] = None, download: bool = True,
                    root_key: str = "data.root") -> Dict[str, Path]:
    """Paths of `{split}.{lang}.gz` under ROOT/multi30k, downloading (and verifying) what is missing.

    Files already there are verified by hash only: no network call is made when all are present. With
    `download=False` (a dataset folder a command only reads) a missing file is an error naming `root_key`."""
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
            elif not download:
                raise FileNotFoundError(f"{folder} has no {name}, and a dataset folder is only read here, never "
                                        f"downloaded into: point {root_key} at a folder holding it")
            else:
                log.info("downloading %s/%s to %s", url.rstrip("/"), name, path)
                fetch(f"{url.rstrip('/')}/{name}", path, table[name], retries=retries, timeout_s=timeout_s,
                      deadline_s=deadline_s, backoff_s=backoff_s, progress=progress, root_key=root_key)
            out[name] = path
    return out
