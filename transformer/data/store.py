"""The preprocessed-folder format: what `transformer-preprocess` writes and `data.preprocessed=DIR` reads
(the in-process cache of data=multi30k/files is the same format, made on the fly).

    manifest.json              counts, dtypes, the tokenizer state, the config that made it, the input files'
                               sha256, and the size + sha256 of every other file; its own "checksum" field
                               is the sha256 of the rest of it
    {split}.{side}.tokens.npy  token ids of every sentence of the split, concatenated (no specials), in the
                               smallest dtype that holds the vocabulary (uint8, uint16 or int32)
    {split}.{side}.offsets.npy int64, sentence i is tokens[offsets[i]:offsets[i + 1]]
    valid.text.jsonl           the raw [source, reference] of each validation pair kept (for BLEU)

Arrays are opened with `np.load(mmap_mode="r")`: the ranks of a node share one copy in the page cache,
and DataLoader workers inherit the mapping instead of a copy. A folder is written under a hidden
temporary name beside its destination and renamed into place once complete, so a reader sees a
finished folder or none; a missing, truncated or altered file is refused with one line naming it.
"""
import hashlib
import json
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from transformer.atomic import fsync_dir

FORMAT, VERSION = "transformer-preprocessed", 1
MANIFEST = "manifest.json"
VALID_TEXT = "valid.text.jsonl"
_HEADER = 128  # bytes of a 1-D .npy header (format 1.0, padded to a multiple of 64)


class PreprocessedError(ValueError):
    """A preprocessed folder that is missing, unfinished, altered or of another format; names the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds every id of a vocabulary of `vocab_size` tokens."""
    for dt in (np.uint8, np.uint16, np.int32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit int32 ids")


def array_files(split: str, side: str) -> Tuple[str, str]:
    return f"{split}.{side}.tokens.npy", f"{split}.{side}.offsets.npy"


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    d = f"{{'descr': {np.lib.format.dtype_to_descr(dtype)!r}, 'fortran_order': False, 'shape': ({n},), }}"
    body = d.ljust(_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


class NpyWriter:
    """A 1-D .npy file written by appending: the header (with the final length) goes in at `close`."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.count = Path(path), np.dtype(dtype), 0
        self._f = open(self.path, "wb")
        self._f.write(b"\0" * _HEADER)

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        if values.size and self.dtype.kind in "ui" and (values.min() < np.iinfo(self.dtype).min
                                                       or values.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"{self.path.name}: values out of {self.dtype} range")
        self._f.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.count += values.size

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, self.count))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class RaggedWriter:
    """tokens + offsets of one side of one split, appended a chunk of sentences at a time."""

    def __init__(self, folder: Path, split: str, side: str, dtype):
        tokens, offsets = array_files(split, side)
        self.tokens, self.offsets = NpyWriter(folder / tokens, dtype), NpyWriter(folder / offsets, np.int64)
        self.offsets.append(np.zeros(1, np.int64))
        self.end = 0  # total tokens so far = the last offset

    def append(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """`flat`: the chunk's ids concatenated; `lengths`: tokens per sentence."""
        self.tokens.append(flat)
        self.offsets.append(self.end + np.cumsum(lengths, dtype=np.int64))
        self.end += int(np.sum(lengths, dtype=np.int64))

    @property
    def sentences(self) -> int:
        return self.offsets.count - 1

    def close(self) -> None:
        self.tokens.close()
        self.offsets.close()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)  # hashlib releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _digests(folder: Path, names: List[str]) -> Dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(folder / n), names), strict=False))


def _manifest_checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


class Staging:
    """The hidden temporary folder a preprocessed folder is written in, renamed to `dest` by `commit`."""

    def __init__(self, dest: Path, overwrite: bool = False):
        self.dest, self.overwrite = Path(dest).absolute(), overwrite
        if self.dest.exists() and not overwrite and (not self.dest.is_dir() or any(self.dest.iterdir())):
            raise PreprocessedError(f"{self.dest} already exists (preprocess.overwrite=true replaces it)")
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            self.folder = self.dest.parent / f".{self.dest.name}.partial-{os.getpid()}-{secrets.token_hex(3)}"
            self.folder.mkdir()
        except OSError as e:
            raise PreprocessedError(f"cannot create {self.dest}: {e.strerror or e}") from None
        self.scratch = self.folder / "scratch"  # spill files of a pass; removed before commit

    def commit(self, manifest: dict) -> Path:
        """Checksums every file, writes manifest.json last and renames the folder into place. A destination
        that appeared meanwhile with a finished manifest (another process won a race for a cache entry) is
        kept; with preprocess.overwrite=true an older folder is replaced."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        names = sorted(p.name for p in self.folder.iterdir())
        digests = _digests(self.folder, names)
        manifest = dict(manifest, format=FORMAT, version=VERSION,
                        files={n: {"bytes": (self.folder / n).stat().st_size, "sha256": digests[n]} for n in names})
        manifest["checksum"] = _manifest_checksum(manifest)
        with open(self.folder / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, ensure_ascii=False, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.folder)
        old = None
        if self.dest.exists() and self.overwrite:
            old = self.dest.parent / f".{self.dest.name}.old-{secrets.token_hex(3)}"
            os.rename(self.dest, old)
        try:
            if self.dest.is_dir() and not any(self.dest.iterdir()):
                self.dest.rmdir()  # an empty folder made beforehand (mkdir -p) is no data to protect
            os.rename(self.folder, self.dest)
        except OSError:
            if not (self.dest / MANIFEST).is_file():  # not a lost race: a real failure
                raise
            self.abort()
        fsync_dir(self.dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def abort(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def write_valid_text(path: Path, pairs) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for src, ref in pairs:
            f.write(json.dumps([src, ref], ensure_ascii=False) + "\n")


class Preprocessed:
    """A finished folder, checked on opening: `verify="sha256"` hashes every file (global rank 0 does this
    once per run), `verify="size"` checks presence and sizes only (the other ranks, after rank 0)."""

    def __init__(self, folder, verify: str = "sha256"):
        self.folder = Path(folder).expanduser()
        self.manifest = read_manifest(self.folder)
        for name, info in self.manifest["files"].items():
            path = self.folder / name
            if not path.is_file():
                raise PreprocessedError(f"{path}: missing (the folder is incomplete: preprocess again)")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise PreprocessedError(f"{path}: {size} bytes but {MANIFEST} records {info['bytes']} "
                                        "(truncated or replaced: preprocess again)")
        if verify == "sha256":
            names = list(self.manifest["files"])
            for name, digest in _digests(self.folder, names).items():
                if digest != self.manifest["files"][name]["sha256"]:
                    raise PreprocessedError(f"{self.folder / name}: sha256 differs from {MANIFEST} "
                                            "(altered or corrupt: preprocess again)")

    @property
    def tokenizer_state(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def src_lang(self) -> str:
        return self.manifest["src_lang"]

    @property
    def tgt_lang(self) -> str:
        return self.manifest["tgt_lang"]

    def arrays(self, split: str, side: str) -> Tuple[Path, Path]:
        tokens, offsets = array_files(split, side)
        return self.folder / tokens, self.folder / offsets

    def valid_text(self) -> Tuple[List[str], List[str]]:
        srcs, refs = [], []
        with open(self.folder / VALID_TEXT, encoding="utf-8") as f:
            for line in f:
                s, r = json.loads(line)
                srcs.append(s)
                refs.append(r)
        return srcs, refs


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not folder.is_dir():
        raise PreprocessedError(f"{folder}: no such folder (make it with transformer-preprocess "
                                f"preprocess.out_dir={folder})")
    if not path.is_file():
        raise PreprocessedError(f"{path}: missing, so {folder} is not a finished preprocessed folder "
                                "(an interrupted run? preprocess again)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise PreprocessedError(f"{path}: unreadable ({e}): preprocess again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreprocessedError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise PreprocessedError(f"{path}: its checksum does not match its content (edited or corrupt: "
                                "preprocess again)")
    if manifest.get("version") != VERSION:
        raise PreprocessedError(f"{path}: format version {manifest.get('version')}, this program reads "
                                f"version {VERSION}: preprocess again")
    return manifest


def open_ragged_arrays(tokens: Path, offsets: Path) -> Tuple[np.ndarray, np.ndarray]:
    """Memory maps of a side's arrays; a file np.load cannot map is refused with its name."""
    out = []
    for path in (tokens, offsets):
        try:
            out.append(np.load(path, mmap_mode="r"))
        except (OSError, ValueError) as e:
            raise PreprocessedError(f"{path}: cannot be memory-mapped ({e}): preprocess again") from None
    data, offs = out
    if offs.ndim != 1 or len(offs) < 1 or int(offs[-1]) != len(data):
        raise PreprocessedError(f"{offsets}: does not match {tokens.name} (preprocess again)")
    return data, offs


def expected_sentences(manifest: dict, split: str) -> Optional[int]:
    return manifest.get("splits", {}).get(split, {}).get("pairs")
