"""Parallel-text datasets (data=multi30k, files, wmt14) turned into the `DataModule` the trainer reads.

The ids come from a preprocessed folder (transformer/data/store.py): `data.preprocessed=DIR` names one made
by `transformer-preprocess`; otherwise rank 0 fetches the files and preprocesses them into the cache
(transformer/data/cache.py) while the other ranks wait, and a second run with the same settings only
loads it. Global rank 0 verifies every file's sha256; the others, after it, check sizes only. Every rank
memory-maps the same arrays.
"""
import logging
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from transformer.data.batch import PairDataset, Ragged
from transformer.data.cache import CACHE_VERSION, cache_key, ensure_cache_folder, entry_path
from transformer.data.corpus import file_digest, read_parallel, resolve
from transformer.data.download import MULTI30K_SHA256, DownloadError, data_root, ensure_multi30k, multi30k_file
from transformer.data.module import DataModule, loader_workers
from transformer.data.preprocess import Options, filter_pairs, preprocess
from transformer.data.store import MANIFEST, Preprocessed, PreprocessedError
from transformer.data.tokenizer import encode_sources, tokenizer_from_state

__all__ = ["build_translation_data", "load_split", "encode_sources", "filter_pairs", "split_files",
           "preprocess_corpus"]

log = logging.getLogger(__name__)
_BAD_INPUT = (DownloadError, FileNotFoundError, ValueError)  # most specific first


def split_files(cfg, split: str, progress: bool = True, download: bool = True,
                root_key: str = "data.root", read_once: bool = False) -> Tuple[Path, Path]:
    """(source file, target file) of `split`, downloading Multi30k files that are not there yet (unless
    `download` is False: then a missing file is an error whose hint names `root_key`). data.files may name
    pipes only for a split that is `read_once` (a test set)."""
    d = cfg.data
    if d.src_lang == d.tgt_lang:
        raise ValueError(f"data.src_lang and data.tgt_lang are both {d.src_lang!r}")
    if d.name == "multi30k":
        paths = ensure_multi30k(data_root(d.root), [split], [d.src_lang, d.tgt_lang], d.url,
                                retries=d.download_retries, timeout_s=d.download_timeout_s,
                                deadline_s=d.download_deadline_s, progress=progress, download=download,
                                root_key=root_key)
        return paths[multi30k_file(split, d.src_lang)], paths[multi30k_file(split, d.tgt_lang)]
    if d.name == "files":
        files = d.files or {}
        if split not in files or not files[split]:
            raise ValueError(f"data.files.{split} is not set (data.files has: {', '.join(files) or 'nothing'}): "
                             f"pass data.files.{split}=PATH_PREFIX for PATH_PREFIX.{d.src_lang} / .{d.tgt_lang}")
        key = f"data.files.{split}={files[split]}"
        return resolve(files[split], d.src_lang, key, read_once), resolve(files[split], d.tgt_lang, key, read_once)
    if d.name == "wmt14":
        from transformer.data.wmt14 import wmt14_files
        return wmt14_files(d, split, progress, download, root_key)
    raise ValueError(f"data.name={d.name!r}: translation data is multi30k, files or wmt14")


def load_split(cfg, name: str, progress: bool = True, download: bool = True,
               root_key: str = "data.root") -> Tuple[List[str], List[str]]:
    """Raw (source, target) sentences of any split, e.g. `test_2016_flickr`, unfiltered and in file order."""
    src_path, tgt_path = split_files(cfg, name, progress, download, root_key, read_once=True)
    return read_parallel(src_path, tgt_path)


def _identity(cfg, src_path: Path, tgt_path: Path) -> List[str]:
    if cfg.data.name == "multi30k":  # already verified against the shipped table
        return [MULTI30K_SHA256[src_path.name], MULTI30K_SHA256[tgt_path.name]]
    if cfg.data.name == "wmt14":  # recorded when they were made
        from transformer.data.wmt14 import recorded_digests
        return recorded_digests(src_path, tgt_path)
    return [file_digest(src_path), file_digest(tgt_path)]


def _key_parts(cfg, identities: Dict[str, List[str]]) -> dict:
    d, t = cfg.data, cfg.tokenizer
    if t.name == "spacy":
        tok = {"name": "spacy", "min_freq": t.min_freq, "max_vocab": t.max_vocab, "lowercase": t.lowercase,
               "lib": metadata.version("spacy")}
    elif t.name == "sentencepiece":
        from transformer.data.spm import cache_key_parts
        tok = cache_key_parts(t, cfg.seed)
    else:
        tok = {"name": t.name, "vocab_size": t.vocab_size, "min_freq": t.min_freq, "lowercase": t.lowercase,
               "train_sample": t.train_sample, "seed": cfg.seed, "lib": metadata.version("tokenizers")}
        if t.tgt_vocab != "full":  # the keys of existing caches stay as they were
            tok["tgt_vocab"] = t.tgt_vocab
    return {"version": CACHE_VERSION, "files": identities, "src_lang": d.src_lang, "tgt_lang": d.tgt_lang,
            "train_split": d.train_split, "valid_split": d.valid_split, "max_len": d.max_len,
            "bad_pairs": d.bad_pairs, "tokenizer": tok}


def _sources(cfg, progress: bool) -> Tuple[Dict[str, Tuple[Path, Path]], Dict[str, List[str]]]:
    """The train and valid files of `cfg.data` (fetched for data=multi30k/wmt14) and their identities."""
    d = cfg.data
    sources = {"train": split_files(cfg, d.train_split, progress), "valid": split_files(cfg, d.valid_split, progress)}
    return sources, {name: _identity(cfg, *paths) for name, paths in sources.items()}


def preprocess_corpus(cfg, out_dir: Path, opts: Options, created_by: str = "transformer-preprocess",
                      tokenizer_state: Optional[dict] = None, sources: Optional[tuple] = None) -> Path:
    """Writes the preprocessed folder `out_dir` of `cfg`'s train and valid splits (transformer/data/preprocess.py)."""
    files, identities = sources or _sources(cfg, opts.progress)
    info = {"created_by": created_by, "inputs": {name: {"files": [str(p) for p in paths], "sha256": identities[name]}
                                                 for name, paths in files.items()}}
    return preprocess(cfg, files, out_dir, opts, tokenizer_state=tokenizer_state, info=info)


def _cache_key(cfg, identities: Dict[str, List[str]], given: Optional[dict] = None) -> str:
    d = cfg.data
    if d.bad_pairs not in ("skip", "error"):
        raise ValueError(f"data.bad_pairs={d.bad_pairs!r}: must be skip or error")
    parts = _key_parts(cfg, {d.train_split: identities["train"], d.valid_split: identities["valid"]})
    if given is not None:  # trainer.init_from's tokenizer, not one learnt from these files
        parts["tokenizer"] = {"given": cache_key(given)}
    return cache_key(parts)


def prepare(cfg, progress: bool = True, tokenizer_state: Optional[dict] = None,
            expect_key: Optional[str] = None, given: Optional[dict] = None) -> Tuple[Path, str]:
    """(folder, key) of the cache entry of `cfg`, downloading and preprocessing as needed; with
    `tokenizer_state`, built with that tokenizer (a rank that cannot see rank 0's cache, which must
    arrive at rank 0's `expect_key`); with `given` (trainer.init_from's tokenizer state), encoded with it
    instead of a tokenizer learnt from the files."""
    sources = _sources(cfg, progress)
    key = _cache_key(cfg, sources[1], given)
    tokenizer_state = tokenizer_state or given
    if expect_key is not None and key != expect_key:
        raise RuntimeError("this rank sees different data files than rank 0 (cache key mismatch)")
    folder = entry_path(cfg.data.cache_dir, data_root(cfg.data.root), key)
    if (folder / MANIFEST).is_file():
        log.info("loading preprocessed %s data from %s", cfg.data.name, folder)
        return folder, key
    log.info("preprocessing %s data (tokenizer=%s) into %s", cfg.data.name, cfg.tokenizer.name, folder)
    ensure_cache_folder(folder.parent)
    return preprocess_corpus(cfg, folder, Options(progress=progress), f"cache {key}", tokenizer_state, sources), key


def _check_preprocessed(cfg, folder: Preprocessed) -> None:
    d, made = cfg.data, folder.manifest["config"]["data"]
    if (d.src_lang, d.tgt_lang) != (folder.src_lang, folder.tgt_lang):
        raise ValueError(f"data.preprocessed={d.preprocessed} holds {folder.src_lang}->{folder.tgt_lang} pairs "
                         f"({MANIFEST}) but data.src_lang={d.src_lang} data.tgt_lang={d.tgt_lang}: set them to match")
    if made.get("name") != d.name:
        log.warning("data.preprocessed=%s was made from data=%s, this run says data=%s (test splits for "
                    "transformer-evaluate come from this run's data config)", d.preprocessed, made.get("name"), d.name)


def _open_on_main(cfg, tokenizer: Optional[dict]) -> Tuple[Preprocessed, tuple]:
    """Rank 0's folder, verified file by file, and what the other ranks need to open theirs."""
    given = cfg.data.preprocessed
    if given:
        folder = Preprocessed(given, verify="sha256")
        _check_preprocessed(cfg, folder)
        return folder, ("ok", str(folder.folder.absolute()), None, None)
    path, key = prepare(cfg, progress=True, given=tokenizer)
    folder = Preprocessed(path, verify="sha256")
    return folder, ("ok", str(path.absolute()), key, folder.tokenizer_state)


def _open_elsewhere(cfg, env, given: Optional[dict], path: str, key: Optional[str],
                    state: Optional[dict]) -> Preprocessed:
    """Ranks > 0 open what rank 0 verified. A cache entry missing from this rank's cache folder is rebuilt
    here with rank 0's tokenizer (data.root/cache_dir not shared); a data.preprocessed folder must be shared."""
    if key is None:
        try:
            return Preprocessed(path, verify="size")
        except PreprocessedError as e:
            raise PreprocessedError(f"rank {env.rank}: {e} (data.preprocessed must be on a file system that every "
                                    "node shares)") from None
    local = entry_path(cfg.data.cache_dir, data_root(cfg.data.root), key)
    if not (local / MANIFEST).is_file():
        log.warning("rank %d: no preprocessed data at %s (data.root/cache_dir not shared with rank 0?): "
                    "building it on this node", env.rank, local)
        local, _ = prepare(cfg, progress=False, tokenizer_state=state, expect_key=key, given=given)
    return Preprocessed(local, verify="size")


def build_translation_data(cfg, env, run_dir: Optional[Path] = None,
                           tokenizer_state: Optional[dict] = None) -> DataModule:
    """The `DataModule` of translation data for this rank (see the module docstring); with `tokenizer_state`
    (trainer.init_from's), encoded with that tokenizer."""
    payload, error, folder = None, None, None
    if env.is_main:
        try:
            folder, payload = _open_on_main(cfg, tokenizer_state)
        except Exception as e:
            if not env.distributed:
                raise
            # The other ranks must not wait forever; bad input goes to them as the same error, so whichever
            # worker a launcher reports first, the user reads the same one line.
            bad = next((c.__name__ for c in _BAD_INPUT if isinstance(e, c)), None)
            error, payload = e, ("error", bad, f"{type(e).__name__}: {e}" if bad is None else str(e))
    env.barrier()  # the other ranks wait here while rank 0 downloads, preprocesses and verifies
    payload = env.broadcast_object(payload)
    if error is not None:
        raise error
    if payload[0] == "error":
        _, bad, message = payload
        if bad is not None:
            raise {c.__name__: c for c in _BAD_INPUT}[bad](message)
        raise RuntimeError(f"rank 0 failed to prepare the data: {message}")
    if folder is None:
        folder = _open_elsewhere(cfg, env, tokenizer_state, *payload[1:])
    tokenizer = tokenizer_from_state(folder.tokenizer_state)
    if env.is_main and run_dir is not None:
        tokenizer.save(Path(run_dir))
    splits = {name: PairDataset(*(Ragged.open(*folder.arrays(name, side)) for side in ("src", "tgt")))
              for name in ("train", "valid")}
    valid_srcs, valid_refs = folder.valid_text()
    if env.is_main:
        log.info("%s %s->%s: %d train / %d valid pairs, vocab %d/%d (%s), from %s", cfg.data.name, folder.src_lang,
                 folder.tgt_lang, len(splits["train"]), len(splits["valid"]), tokenizer.src_vocab_size,
                 tokenizer.tgt_vocab_size, "shared" if tokenizer.shared_vocab else "separate", folder.folder)
    train_of_epoch = None
    if cfg.data.bpe_dropout > 0:
        from transformer.data.bpe_dropout import BpeDropout
        dropped = BpeDropout(tokenizer, splits["train"], cfg.data.bpe_dropout, cfg.data.bpe_dropout_samples,
                             cfg.seed, cfg.data.max_len)
        start = cfg.data.bpe_dropout_from_epoch

        def train_of_epoch(epoch: int) -> PairDataset:
            return dropped.epoch(epoch) if epoch >= start else splits["train"]
    num_workers = loader_workers(cfg.data.num_workers, env.device)
    return DataModule(splits["train"], splits["valid"], tokenizer,
                      max_tokens=cfg.data.max_tokens, max_sentences=cfg.data.max_sentences, seed=cfg.seed,
                      rank=env.rank, world_size=env.world_size, num_workers=num_workers,
                      pin_memory=env.device.type == "cuda", valid_srcs=valid_srcs, valid_refs=valid_refs,
                      max_tokens_by_epoch=cfg.data.max_tokens_by_epoch, train_of_epoch=train_of_epoch)
