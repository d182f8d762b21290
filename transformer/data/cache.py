"""The preprocessing cache: token ids of the train/valid splits, stored once per (data, tokenizer) setting.

An entry is a folder CACHE_DIR/<key> where key = sha256 of everything that changes the ids (file
checksums, tokenizer config and library version, languages, max_len, bad_pairs, CACHE_VERSION).
It is written to a temporary folder beside it and renamed into place in one step, so a reader sees
either nothing or a complete entry, and two writers racing for one key cannot corrupt it.
"""
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from transformer.atomic import fsync_dir
from transformer.data.batch import Ragged
from transformer.data.download import default_root

# Bump when tokenisation, filtering or the stored layout changes: old entries are then ignored.
CACHE_VERSION = 1


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


class CacheEntry:
    """Files: {split}.src.npz / {split}.tgt.npz (Ragged ids), tokenizer.json (state_dict), meta.json
    (the key's parts, counts of skipped pairs, and any extra JSON such as the raw validation text)."""

    def __init__(self, folder: Path, key: str):
        self.folder, self.key = Path(folder), key
        self.path = self.folder / key[:32]

    def exists(self) -> bool:
        return (self.path / "meta.json").is_file()

    def write(self, splits: Dict[str, Tuple[Ragged, Ragged]], tokenizer_state: dict, meta: dict) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the preprocessing cache folder {self.folder}: {e} "
                             "(set data.cache_dir to a writable folder)") from None
        tmp = self.folder / f".{self.path.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for split, (src, tgt) in splits.items():
                for side, r in (("src", src), ("tgt", tgt)):
                    with open(tmp / f"{split}.{side}.npz", "wb") as f:
                        np.savez(f, data=r.data, offsets=r.offsets)
                        f.flush()
                        os.fsync(f.fileno())
            for name, obj in (("tokenizer.json", tokenizer_state), ("meta.json", dict(meta, key=self.key))):
                with open(tmp / name, "w", encoding="utf-8") as f:
                    json.dump(obj, f, ensure_ascii=False)
                    f.flush()
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            try:
                os.rename(tmp, self.path)
            except OSError:
                if not self.exists():  # not a lost race: a real failure
                    raise
            fsync_dir(self.folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self) -> Tuple[Dict[str, Tuple[Ragged, Ragged]], dict, dict]:
        with open(self.path / "meta.json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(self.path / "tokenizer.json", encoding="utf-8") as f:
            state = json.load(f)
        splits = {s: (Ragged.load(self.path / f"{s}.src.npz"), Ragged.load(self.path / f"{s}.tgt.npz"))
                  for s in meta["splits"]}
        return splits, state, meta


def cache_folder(cache_dir: Optional[str], root: Path) -> Path:
    """data.cache_dir, else the user's cache dir: a data.root naming a dataset folder is only read, never written
    into (unless files are missing there and must be downloaded)."""
    return Path(cache_dir).expanduser() if cache_dir else default_root() / "cache"
