"""Tokenise and binarise a parallel corpus into a preprocessed folder (transformer/data/store.py), in
memory bounded by the chunk size, never by the corpus.

1. Both files of every split are read through once to check them (UTF-8, alignment) and count pairs.
2. The tokenizer is learnt from the training split only. BPE (HF `tokenizers`) and SentencePiece train from
   a stream of at most `tokenizer.train_sample` sentences drawn with `seed`; spaCy vocabularies are counted
   chunk by chunk (transformer/data/vocab_stream.py), their provisional ids spilled to a scratch folder.
3. Chunks of `chunk_size` pairs are encoded by `workers` processes and written in input order, so the
   folder is byte-identical for any number of workers. Empty or over-long pairs are skipped (counted) or
   refused with their line number, as `data.bad_pairs` says.
"""
import json
import logging
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from omegaconf import OmegaConf

from transformer.data.corpus import count_pairs, iter_lines, iter_pairs
from transformer.data.encode import encode_pair_chunk, worker_init
from transformer.data.store import VALID_TEXT, RaggedWriter, Staging, token_dtype, write_valid_text
from transformer.data.tokenizer import BpeTokenizer, SpacyTokenizer, check_tokenizer_config, tokenizer_from_state
from transformer.data.vocab_stream import VocabCounter, strings_to_ids

log = logging.getLogger(__name__)
SIDES = ("src", "tgt")


@dataclass
class Options:
    """The `preprocess` config group's knobs that do not change the output (only how fast it is made)."""
    workers: int = 1
    chunk_size: int = 10000
    overwrite: bool = False
    progress: bool = True


class OrderedPool:
    """`fn(*task)` over a stream of tasks on `workers` spawned processes, results in task order, with at most
    2 * workers tasks in flight (so reading never runs ahead of encoding). One worker: runs in-process."""

    def __init__(self, workers: int):
        self.workers, self._pool = workers, None

    def map(self, fn: Callable, tasks: Iterable[Tuple[object, tuple]]) -> Iterator[Tuple[object, object]]:
        """`tasks`: (key, args) pairs; yields (key, fn(*args)). Keys stay in this process."""
        if self.workers <= 1:
            for key, args in tasks:
                yield key, fn(*args)
            return
        if self._pool is None:
            # spawn, not fork: a child of a large parent (spaCy's string table, HF's threads) starts clean,
            # and `fn` lives in a module that does not import torch.
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers, initializer=worker_init)
        pending = deque()
        for key, args in tasks:
            pending.append((key, self._pool.apply_async(fn, args)))
            if len(pending) >= 2 * self.workers:
                key, res = pending.popleft()
                yield key, res.get()
        while pending:
            key, res = pending.popleft()
            yield key, res.get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def filter_lengths(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, bad_pairs: str, src_path: Path,
                   tgt_path: Path, first_line: int = 1) -> Tuple[np.ndarray, Dict[str, int]]:
    """Mask of the pairs kept: empty or over-length pairs (more than max_len tokens a side) are dropped
    and counted (bad_pairs=skip) or reported with their line number (bad_pairs=error)."""
    empty = (src_len == 0) | (tgt_len == 0)
    long = ~empty & ((src_len > max_len) | (tgt_len > max_len))
    if bad_pairs == "error" and (empty.any() or long.any()):
        i = int(np.argmax(empty | long))
        line = first_line + i
        if empty[i]:
            path = src_path if src_len[i] == 0 else tgt_path
            raise ValueError(f"{path}, line {line}: empty sentence (data.bad_pairs=error; "
                             "data.bad_pairs=skip drops such pairs)")
        path, n = (src_path, src_len[i]) if src_len[i] > max_len else (tgt_path, tgt_len[i])
        raise ValueError(f"{path}, line {line}: {n} tokens, more than data.max_len={max_len} "
                         "(data.bad_pairs=error; data.bad_pairs=skip drops such pairs)")
    return ~(empty | long), {"empty": int(empty.sum()), "too_long": int(long.sum())}


def filter_pairs(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], max_len: int, bad_pairs: str,
                 src_path: Path, tgt_path: Path) -> Tuple[List[int], Dict[str, int]]:
    """`filter_lengths` for id lists: indices of the pairs kept, and the skipped counts."""
    keep, skipped = filter_lengths(np.array([len(s) for s in src_ids]), np.array([len(t) for t in tgt_ids]),
                                   max_len, bad_pairs, src_path, tgt_path)
    return np.nonzero(keep)[0].tolist(), skipped


def _kept_tokens(flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    return flat[np.repeat(keep, lengths)], lengths[keep]


class _Run:
    """One preprocessing run: scratch state shared by its passes."""

    def __init__(self, cfg, sources: Dict[str, Tuple[Path, Path]], staging: Staging, opts: Options):
        self.cfg, self.d, self.t = cfg, cfg.data, cfg.tokenizer
        self.sources, self.staging, self.opts = sources, staging, opts
        self.pool = OrderedPool(opts.workers)
        self.splits: Dict[str, dict] = {}

    def bar(self, total: int, desc: str):
        from tqdm import tqdm
        return tqdm(total=total, unit=" pairs", unit_scale=True, desc=desc, disable=not self.opts.progress,
                    leave=False, mininterval=1.0)

    def chunks(self, name: str) -> Iterator[tuple]:
        """(first line number, source lines, target lines) of split `name`, chunk by chunk."""
        line = 1
        for src, tgt in iter_pairs(*self.sources[name], self.opts.chunk_size):
            yield line, src, tgt
            line += len(src)

    def filter(self, name: str, line: int, src_len: np.ndarray, tgt_len: np.ndarray, stats: dict) -> np.ndarray:
        keep, skipped = filter_lengths(src_len, tgt_len, self.d.max_len, self.d.bad_pairs, *self.sources[name],
                                       first_line=line)
        for k, v in skipped.items():
            stats["skipped"][k] += v
        return keep

    def new_stats(self, name: str, n: int) -> dict:
        split = self.d.train_split if name == "train" else self.d.valid_split
        self.splits[name] = {"split": split, "lines": n, "pairs": 0, "skipped": {"empty": 0, "too_long": 0},
                             "tokens": {"src": 0, "tgt": 0}}
        return self.splits[name]

    def finish_split(self, name: str, writers: Dict[str, RaggedWriter], stats: dict) -> None:
        for side, w in writers.items():
            w.close()
            stats["tokens"][side] = w.end
        stats["pairs"] = writers["src"].sentences
        src_path = self.sources[name][0]
        if not stats["pairs"]:
            raise ValueError(f"{src_path}: no usable pair in split {stats['split']!r} (data.max_len={self.d.max_len})")
        if any(stats["skipped"].values()):
            log.warning("split %s: skipped %d empty and %d over-length (> data.max_len=%d tokens) pairs of %d",
                        stats["split"], stats["skipped"]["empty"], stats["skipped"]["too_long"], self.d.max_len,
                        stats["lines"])

    # ---- the tokenizer ---------------------------------------------------------------------------------
    def train_sample(self, n: int, what: str) -> Tuple[Iterator[List[str]], int]:
        """(chunks of sentences, their number): the source then the target lines of the training split, or a
        sample of `tokenizer.train_sample` of those 2n lines drawn with `seed` (in file order)."""
        total, k = 2 * n, self.t.train_sample
        sample = None
        if k is not None and k < total:
            sample = np.sort(np.random.default_rng(self.cfg.seed).choice(total, size=k, replace=False))
        log.info("learning %s (vocab_size=%d) from %d of the %d training sentences", what, self.t.vocab_size,
                 total if sample is None else k, total)

        def sentences():
            base = 0
            with self.bar(total, f"{self.t.name} sample") as bar:
                for path in self.sources["train"]:
                    for lines in iter_lines(path, self.opts.chunk_size):
                        if sample is None:
                            yield lines
                        else:
                            lo, hi = np.searchsorted(sample, [base, base + len(lines)])
                            yield [lines[j - base] for j in sample[lo:hi]]
                        base += len(lines)
                        bar.update(len(lines))

        return sentences(), total if sample is None else k

    def train_bpe(self, n: int) -> BpeTokenizer:
        """Merges learnt from the training sample (`train_sample`)."""
        sentences, k = self.train_sample(n, "BPE merges")
        tok = BpeTokenizer.train(sentences, self.t.vocab_size, max(self.t.min_freq, 0), self.t.lowercase,
                                 self.d.src_lang, self.d.tgt_lang, length=k)
        return self.seen_targets(tok, n)

    def train_sentencepiece(self, n: int):
        """A SentencePiece model from tokenizer.model_file, or learnt from the training sample."""
        from transformer.data import spm
        if self.t.model_file is not None:
            tok = spm.build(self.t, self.d.src_lang, self.d.tgt_lang)
        else:
            sentences, _ = self.train_sample(n, f"a SentencePiece {self.t.model_type} model")
            tok = spm.build(self.t, self.d.src_lang, self.d.tgt_lang, sentences, self.cfg.seed)
        return self.seen_targets(tok, n)

    def seen_targets(self, tok, n: int):
        """`tok`, renumbered with the training targets' types first under tokenizer.tgt_vocab=seen."""
        if self.t.tgt_vocab != "seen":
            return tok

        def targets():  # every training target, not the sample: a type the sample missed is still seen
            with self.bar(n, "target types") as bar:
                for lines in iter_lines(self.sources["train"][1], self.opts.chunk_size):
                    yield lines
                    bar.update(len(lines))

        return tok.seen_targets_first(targets())

    def specs(self, tokenizer) -> Tuple[tuple, tuple]:
        if tokenizer is None or tokenizer.name == "spacy":
            lowercase = self.t.lowercase if tokenizer is None else tokenizer.lowercase
            return ("spacy", self.d.src_lang, lowercase), ("spacy", self.d.tgt_lang, lowercase)
        if tokenizer.name == "sentencepiece_pair":  # imported (trainer.init_from): a model per side
            path = self.staging.scratch / "spm_pair.json"
            if not path.exists():
                self.staging.scratch.mkdir(exist_ok=True)
                path.write_text(json.dumps(tokenizer.state_dict()), encoding="utf-8")
            return (tokenizer.name, str(path), "src"), (tokenizer.name, str(path), "tgt")
        path = self.staging.scratch / ("spm.model" if tokenizer.name == "sentencepiece" else "bpe.json")
        if not path.exists():
            self.staging.scratch.mkdir(exist_ok=True)
            if tokenizer.name == "sentencepiece":
                path.write_bytes(tokenizer.proto)
            else:
                tokenizer.tok.save(str(path))
        return (tokenizer.name, str(path), None), (tokenizer.name, str(path), tokenizer.n_tgt)

    # ---- encoding with a finished tokenizer ------------------------------------------------------------
    def encode(self, name: str, tokenizer, n: int, dtype) -> None:
        stats = self.new_stats(name, n)
        writers = {side: RaggedWriter(self.staging.folder, name, side, dtype) for side in SIDES}
        vocabs = {"src": getattr(tokenizer, "src_vocab", None), "tgt": getattr(tokenizer, "tgt_vocab", None)}
        src_spec, tgt_spec = self.specs(tokenizer)
        tasks = (((line, src, tgt), (src_spec, tgt_spec, src, tgt)) for line, src, tgt in self.chunks(name))
        with self.bar(n, name) as bar:
            for (line, src, tgt), results in self.pool.map(encode_pair_chunk, tasks):
                ids = {}
                for side, res in zip(SIDES, results, strict=False):
                    ids[side] = (strings_to_ids(vocabs[side], res[0], res[1]), res[2]) if len(res) == 4 else res
                keep = self.filter(name, line, ids["src"][1], ids["tgt"][1], stats)
                for side in SIDES:
                    writers[side].append(*_kept_tokens(*ids[side], keep))
                if name == "valid":  # raw text of the kept pairs: valid example i <-> line i of valid.text.jsonl
                    write_valid_text(self.staging.folder / VALID_TEXT,
                                     ((src[i].strip(), tgt[i].strip()) for i in np.nonzero(keep)[0]))
                bar.update(len(src))
        self.finish_split(name, writers, stats)

    # ---- spaCy vocabularies, counted while tokenising the training split -----------------------------------
    def spacy_train(self, n: int) -> SpacyTokenizer:
        """Pass 1 tokenises the training split, counts and spills provisional ids; pass 2 reads the spill,
        counts right-glue and writes the final ids."""
        self.staging.scratch.mkdir(exist_ok=True)
        stats = self.new_stats("train", n)
        counters = {side: VocabCounter() for side in SIDES}
        spill = {f"{side}.{kind}": open(self.staging.scratch / f"{side}.{kind}", "wb")
                 for side in SIDES for kind in ("ids", "lengths", "nospace")}
        spill["keep"] = open(self.staging.scratch / "keep", "wb")
        tasks = (((line, len(src)), (*self.specs(None), src, tgt)) for line, src, tgt in self.chunks("train"))
        with self.bar(n, "train (spaCy)") as bar:
            for (line, pairs), results in self.pool.map(encode_pair_chunk, tasks):
                for side, (strings, local, lengths, nospace) in zip(SIDES, results, strict=False):
                    spill[f"{side}.ids"].write(counters[side].add(strings, local, lengths, nospace).tobytes())
                    spill[f"{side}.lengths"].write(lengths.tobytes())
                    spill[f"{side}.nospace"].write(nospace.tobytes())
                keep = self.filter("train", line, results[0][2], results[1][2], stats)
                spill["keep"].write(keep.tobytes())
                bar.update(pairs)
        for f in spill.values():
            f.close()
        words = {side: counters[side].words(self.t.min_freq, self.t.max_vocab) for side in SIDES}
        dtype = token_dtype(max(len(w) for w in words.values()) + 4)
        tables = {side: counters[side].id_table(words[side]) for side in SIDES}
        writers = {side: RaggedWriter(self.staging.folder, "train", side, dtype) for side in SIDES}
        keep = np.fromfile(self.staging.scratch / "keep", dtype=bool)
        with self.bar(n, "train (ids)") as bar:
            for side in SIDES:
                for ids, lengths, nospace, kept in self._read_spill(side, keep):
                    counters[side].add_right(ids, lengths, nospace)
                    writers[side].append(*_kept_tokens(tables[side][ids], lengths, kept))
                    bar.update(len(lengths) // 2)
        self.finish_split("train", writers, stats)
        vocabs = [counters[side].vocab(words[side]) for side in SIDES]
        return SpacyTokenizer(self.d.src_lang, self.d.tgt_lang, *vocabs, self.t.lowercase)

    def _read_spill(self, side: str, keep: np.ndarray):
        lengths = np.fromfile(self.staging.scratch / f"{side}.lengths", dtype=np.int32)
        ends = np.cumsum(lengths, dtype=np.int64)
        ids = np.memmap(self.staging.scratch / f"{side}.ids", dtype=np.int32, mode="r") if ends[-1] else None
        nospace = np.memmap(self.staging.scratch / f"{side}.nospace", dtype=bool, mode="r") if ends[-1] else None
        step = 8 * self.opts.chunk_size
        for a in range(0, len(lengths), step):
            b = min(a + step, len(lengths))
            lo, hi = (ends[a - 1] if a else 0), ends[b - 1]
            if ids is None:
                yield np.zeros(0, np.int32), lengths[a:b], np.zeros(0, bool), keep[a:b]
            else:
                yield np.asarray(ids[lo:hi]), lengths[a:b], np.asarray(nospace[lo:hi]), keep[a:b]


def preprocess(cfg, sources: Dict[str, Tuple[Path, Path]], out_dir: Path, opts: Optional[Options] = None, *,
               tokenizer_state: Optional[dict] = None, info: Optional[dict] = None) -> Path:
    """Writes the folder `out_dir` from `sources` {"train": (src, tgt), "valid": (src, tgt)} under `cfg`'s data
    and tokenizer settings; with `tokenizer_state`, that tokenizer instead of a new one. `info` goes into the
    manifest (input checksums, who made it). Returns the folder; on any error nothing is left behind."""
    d = cfg.data
    check_tokenizer_config(cfg.tokenizer)
    if d.bad_pairs not in ("skip", "error"):
        raise ValueError(f"data.bad_pairs={d.bad_pairs!r}: must be skip or error")
    opts = opts or Options()
    if opts.workers < 1 or opts.chunk_size < 1:
        raise ValueError(f"preprocess.workers={opts.workers}, preprocess.chunk_size={opts.chunk_size}: must be >= 1")
    t0 = time.time()
    counts = {name: count_pairs(*paths) for name, paths in sources.items()}  # bad files fail before any work
    log.info("checked the input files: %d train, %d valid pairs (%.1f s)", counts["train"], counts["valid"],
             time.time() - t0)
    staging = Staging(out_dir, opts.overwrite)
    run = _Run(cfg, sources, staging, opts)
    try:
        t = time.time()
        if tokenizer_state is not None:
            tokenizer = tokenizer_from_state(tokenizer_state)
        elif cfg.tokenizer.name == "bpe":
            tokenizer = run.train_bpe(counts["train"])
        elif cfg.tokenizer.name == "sentencepiece":
            tokenizer = run.train_sentencepiece(counts["train"])
        else:
            tokenizer = run.spacy_train(counts["train"])
        log.info("tokenizer %s ready (%.1f s)", cfg.tokenizer.name if tokenizer_state is None else "given",
                 time.time() - t)
        dtype = token_dtype(max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size))
        for name in ("train", "valid"):
            if name not in run.splits:
                t = time.time()
                run.encode(name, tokenizer, counts[name], dtype)
                log.info("encoded %s with %d worker(s) (%.1f s)", name, opts.workers, time.time() - t)
        manifest = {
            "src_lang": d.src_lang, "tgt_lang": d.tgt_lang,
            "vocab": {"src": tokenizer.src_vocab_size, "tgt": tokenizer.tgt_vocab_size,
                      "shared": tokenizer.shared_vocab},
            "dtypes": {"tokens": dtype.name, "offsets": "int64"},
            "splits": run.splits,
            "tokenizer": tokenizer.state_dict(),
            "config": {"data": OmegaConf.to_container(cfg.data, resolve=True),
                       "tokenizer": OmegaConf.to_container(cfg.tokenizer, resolve=True), "seed": cfg.seed},
            **(info or {}),
        }
        folder = staging.commit(manifest)
    except BaseException:
        staging.abort()
        raise
    finally:
        run.pool.close()
    log.info("preprocessed %d train / %d valid pairs in %.1f s into %s", run.splits["train"]["pairs"],
             run.splits["valid"]["pairs"], time.time() - t0, folder)
    return folder
