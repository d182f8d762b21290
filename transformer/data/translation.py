"""Parallel-text datasets (data=multi30k, data=files) turned into the `DataModule` the trainer reads.

Rank 0 fetches the files, trains the tokenizer on the training split only, encodes train and valid
and stores the ids in the preprocessing cache (transformer/data/cache.py) while the other ranks wait;
then every rank loads the same cache entry. A second run with the same settings only loads it.
"""
import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from transformer.data.batch import PairDataset, Ragged
from transformer.data.cache import CACHE_VERSION, CacheEntry, cache_folder, cache_key
from transformer.data.corpus import file_digest, read_parallel, resolve
from transformer.data.download import MULTI30K_SHA256, DownloadError, data_root, ensure_multi30k, multi30k_file
from transformer.data.module import DataModule
from transformer.data.tokenizer import encode_sources, tokenizer_from_state, train_tokenizer

__all__ = ["build_translation_data", "load_split", "encode_sources", "split_files"]

log = logging.getLogger(__name__)
_BAD_INPUT = (DownloadError, FileNotFoundError, ValueError)  # most specific first


def split_files(cfg, split: str, progress: bool = True) -> Tuple[Path, Path]:
    """(source file, target file) of `split`, downloading Multi30k files that are not there yet."""
    d = cfg.data
    if d.src_lang == d.tgt_lang:
        raise ValueError(f"data.src_lang and data.tgt_lang are both {d.src_lang!r}")
    if d.name == "multi30k":
        paths = ensure_multi30k(data_root(d.root), [split], [d.src_lang, d.tgt_lang], d.url,
                                retries=d.download_retries, timeout_s=d.download_timeout_s, progress=progress)
        return paths[multi30k_file(split, d.src_lang)], paths[multi30k_file(split, d.tgt_lang)]
    if d.name == "files":
        files = d.files or {}
        if split not in files or not files[split]:
            raise ValueError(f"data.files.{split} is not set (data.files has: {', '.join(files) or 'nothing'}): "
                             f"pass data.files.{split}=PATH_PREFIX for PATH_PREFIX.{d.src_lang} / .{d.tgt_lang}")
        return resolve(files[split], d.src_lang), resolve(files[split], d.tgt_lang)
    raise ValueError(f"data.name={d.name!r}: translation data is multi30k or files")


def load_split(cfg, name: str, progress: bool = True) -> Tuple[List[str], List[str]]:
    """Raw (source, target) sentences of any split, e.g. `test_2016_flickr`, unfiltered and in file order."""
    src_path, tgt_path = split_files(cfg, name, progress)
    return read_parallel(src_path, tgt_path)


def _identity(cfg, src_path: Path, tgt_path: Path) -> List[str]:
    if cfg.data.name == "multi30k":  # already verified against the shipped table
        return [MULTI30K_SHA256[src_path.name], MULTI30K_SHA256[tgt_path.name]]
    return [file_digest(src_path), file_digest(tgt_path)]


def _key_parts(cfg, identities: Dict[str, List[str]]) -> dict:
    d, t = cfg.data, cfg.tokenizer
    if t.name == "spacy":
        tok = {"name": "spacy", "min_freq": t.min_freq, "max_vocab": t.max_vocab, "lowercase": t.lowercase,
               "lib": metadata.version("spacy")}
    else:
        tok = {"name": t.name, "vocab_size": t.vocab_size, "min_freq": t.min_freq, "lowercase": t.lowercase,
               "lib": metadata.version("tokenizers")}
    return {"version": CACHE_VERSION, "files": identities, "src_lang": d.src_lang, "tgt_lang": d.tgt_lang,
            "train_split": d.train_split, "valid_split": d.valid_split, "max_len": d.max_len,
            "bad_pairs": d.bad_pairs, "tokenizer": tok}


def filter_pairs(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], max_len: int, bad_pairs: str,
                 src_path: Path, tgt_path: Path) -> Tuple[List[int], Dict[str, int]]:
    """Indices of the pairs kept: empty or over-length pairs (more than max_len tokens a side) are
    dropped and counted (bad_pairs=skip) or reported with their line number (bad_pairs=error)."""
    keep, empty, long = [], 0, 0
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
        if not len(s) or not len(t):
            if bad_pairs == "error":
                path = src_path if not len(s) else tgt_path
                raise ValueError(f"{path}, line {i + 1}: empty sentence (data.bad_pairs=error; "
                                 "data.bad_pairs=skip drops such pairs)")
            empty += 1
        elif len(s) > max_len or len(t) > max_len:
            if bad_pairs == "error":
                path, n = (src_path, len(s)) if len(s) > max_len else (tgt_path, len(t))
                raise ValueError(f"{path}, line {i + 1}: {n} tokens, more than data.max_len={max_len} "
                                 "(data.bad_pairs=error; data.bad_pairs=skip drops such pairs)")
            long += 1
        else:
            keep.append(i)
    return keep, {"empty": empty, "too_long": long}


def _encode_split(tokenizer, src: List[str], tgt: List[str]) -> Tuple[List[List[int]], List[List[int]]]:
    return encode_sources(tokenizer, src), tokenizer.encode_tgt_batch(tgt)


def _build_entry(cfg, entry: CacheEntry, key_parts: dict, paths: Dict[str, Tuple[Path, Path]],
                 tokenizer_state: Optional[dict] = None) -> None:
    """Reads, tokenises, filters and stores the train and valid splits. With `tokenizer_state`, that
    tokenizer is used instead of training one (a rank that cannot see rank 0's cache)."""
    d = cfg.data
    texts = {s: read_parallel(*paths[s]) for s in (d.train_split, d.valid_split)}
    train_src, train_tgt = texts[d.train_split]
    if tokenizer_state is None:
        tokenizer = train_tokenizer(cfg.tokenizer, d.src_lang, d.tgt_lang, train_src, train_tgt)
    else:
        tokenizer = tokenizer_from_state(tokenizer_state)
    splits, meta = {}, {"parts": key_parts, "splits": ["train", "valid"], "skipped": {}, "sizes": {}}
    for name, split in (("train", d.train_split), ("valid", d.valid_split)):
        src, tgt = texts[split]
        if name == "train" and getattr(tokenizer, "train_ids", None) is not None:
            src_ids, tgt_ids = tokenizer.train_ids  # spaCy tokenised train once while building the vocabulary
        else:
            src_ids, tgt_ids = _encode_split(tokenizer, src, tgt)
        keep, skipped = filter_pairs(src_ids, tgt_ids, d.max_len, d.bad_pairs, *paths[split])
        if not keep:
            raise ValueError(f"{paths[split][0]}: no usable pair in split {split!r} (data.max_len={d.max_len})")
        if any(skipped.values()):
            log.warning("split %s: skipped %d empty and %d over-length (> data.max_len=%d tokens) pairs of %d",
                        split, skipped["empty"], skipped["too_long"], d.max_len, len(src))
        splits[name] = (Ragged.from_lists([src_ids[i] for i in keep]), Ragged.from_lists([tgt_ids[i] for i in keep]))
        meta["skipped"][name], meta["sizes"][name] = skipped, len(keep)
        if name == "valid":  # raw text of the kept pairs: valid example i <-> valid_srcs[i], valid_refs[i]
            meta["valid_srcs"] = [src[i].strip() for i in keep]
            meta["valid_refs"] = [tgt[i].strip() for i in keep]
    if hasattr(tokenizer, "train_ids"):
        del tokenizer.train_ids
    entry.write(splits, tokenizer.state_dict(), meta)


def prepare(cfg, progress: bool = True) -> CacheEntry:
    """Makes sure the cache entry of `cfg` exists (downloading and building as needed) and returns it."""
    d = cfg.data
    if d.bad_pairs not in ("skip", "error"):
        raise ValueError(f"data.bad_pairs={d.bad_pairs!r}: must be skip or error")
    paths = {s: split_files(cfg, s, progress) for s in dict.fromkeys((d.train_split, d.valid_split))}
    identities = {s: _identity(cfg, *p) for s, p in paths.items()}
    parts = _key_parts(cfg, identities)
    entry = CacheEntry(cache_folder(d.cache_dir, data_root(d.root)), cache_key(parts))
    if entry.exists():
        log.info("loading preprocessed %s data from %s", d.name, entry.path)
    else:
        log.info("preprocessing %s data (tokenizer=%s) into %s", d.name, cfg.tokenizer.name, entry.path)
        _build_entry(cfg, entry, parts, paths)
    return entry


def build_translation_data(cfg, env, run_dir: Optional[Path] = None) -> DataModule:
    """The `DataModule` of data=multi30k or data=files for this rank (see the module docstring)."""
    payload, error = None, None
    if env.is_main:
        try:
            entry = prepare(cfg, progress=True)
            with open(entry.path / "tokenizer.json", encoding="utf-8") as f:
                payload = ("ok", entry.key, json.load(f))
        except Exception as e:
            if not env.distributed:
                raise
            # The other ranks must not wait forever; bad input goes to them as the same error, so whichever
            # worker a launcher reports first, the user reads the same one line.
            bad = next((c.__name__ for c in _BAD_INPUT if isinstance(e, c)), None)
            error, payload = e, ("error", bad, f"{type(e).__name__}: {e}" if bad is None else str(e))
    env.barrier()  # the other ranks wait here while rank 0 downloads and preprocesses
    payload = env.broadcast_object(payload)
    if error is not None:
        raise error
    if payload[0] == "error":
        _, bad, message = payload
        if bad is not None:
            raise {c.__name__: c for c in _BAD_INPUT}[bad](message)
        raise RuntimeError(f"rank 0 failed to prepare the data: {message}")
    _, key, tokenizer_state = payload
    entry = CacheEntry(cache_folder(cfg.data.cache_dir, data_root(cfg.data.root)), key)
    if not entry.exists():
        # This rank does not share rank 0's filesystem (e.g. a node-local ~/.cache): build the same entry
        # here, with rank 0's tokenizer, and check it matches.
        log.warning("rank %d: no preprocessed data at %s (data.root/cache_dir not shared with rank 0?): "
                    "building it on this node", env.rank, entry.path)
        d = cfg.data
        paths = {s: split_files(cfg, s, progress=False) for s in dict.fromkeys((d.train_split, d.valid_split))}
        parts = _key_parts(cfg, {s: _identity(cfg, *p) for s, p in paths.items()})
        if cache_key(parts) != key:
            raise RuntimeError(f"rank {env.rank} sees different data files than rank 0 (cache key mismatch)")
        _build_entry(cfg, entry, parts, paths, tokenizer_state)
    splits, state, meta = entry.load()
    tokenizer = tokenizer_from_state(state)
    if env.is_main and run_dir is not None:
        tokenizer.save(Path(run_dir))
    if env.is_main:
        log.info("%s %s->%s: %d train / %d valid pairs, vocab %d/%d (%s)", cfg.data.name, cfg.data.src_lang,
                 cfg.data.tgt_lang, meta["sizes"]["train"], meta["sizes"]["valid"], tokenizer.src_vocab_size,
                 tokenizer.tgt_vocab_size, "shared" if tokenizer.shared_vocab else "separate")
    num_workers = cfg.data.num_workers
    if num_workers is None:
        num_workers = 2 if env.device.type == "cuda" else 0
    return DataModule(PairDataset(*splits["train"]), PairDataset(*splits["valid"]), tokenizer,
                      max_tokens=cfg.data.max_tokens, max_sentences=cfg.data.max_sentences, seed=cfg.seed,
                      rank=env.rank, world_size=env.world_size, num_workers=num_workers,
                      pin_memory=env.device.type == "cuda", valid_srcs=meta["valid_srcs"],
                      valid_refs=meta["valid_refs"])
