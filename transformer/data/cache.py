"""The preprocessing cache: without `data.preprocessed`, data=multi30k/files/wmt14 are preprocessed on the fly
into the same folder format `transformer-preprocess` writes (transformer/data/store.py), once per setting.

An entry is a folder CACHE_DIR/<key> where key = sha256 of everything that changes the ids (file
checksums, tokenizer config and library version, languages, max_len, bad_pairs, CACHE_VERSION).
It is written to a temporary folder beside it and renamed into place in one step, so a reader sees
either nothing or a complete entry, and two writers racing for one key cannot corrupt it.
"""
import hashlib
import json
from pathlib import Path
from typing import Optional

from transformer.data.download import default_root

# Bump when tokenisation, filtering or the stored layout changes: old entries are then ignored.
CACHE_VERSION = 2


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def cache_folder(cache_dir: Optional[str], root: Path) -> Path:
    """data.cache_dir, else the user's cache dir: a data.root naming a dataset folder is only read, never written
    into (unless files are missing there and must be downloaded)."""
    return Path(cache_dir).expanduser() if cache_dir else default_root() / "cache"


def entry_path(cache_dir: Optional[str], root: Path, key: str) -> Path:
    return cache_folder(cache_dir, root) / key[:32]


def ensure_cache_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the preprocessing cache folder {folder}: {e} "
                         "(set data.cache_dir to a writable folder)") from None
