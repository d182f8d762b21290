"""Typed schemas of the `data` and `tokenizer` config groups, and of `transformer-preprocess`'s config."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import MISSING

SHAPE_STEPS = (2, 4, 8, 16)  # trainer.shape_steps: static-shape ladder lengths an octave (data/shapes.py)


@dataclass
class CopyConfig:
    """The synthetic copy task (Annotated Transformer, "A First Example")."""
    vocab_size: int = 11  # symbols 4..vocab_size-1 after the 4 specials
    seq_len: int = 10  # symbols a sequence
    train_size: int = 20000  # training sequences
    val_size: int = 500  # validation sequences
    test_size: int = 1000  # fresh sequences for the exact-match accuracy


@dataclass
class Wmt14Config:
    """Cleaning of the WMT14 training corpora (transformer/data/wmt14.py), on whitespace-separated words."""
    max_words: int = 250  # a pair with a longer side is dropped
    max_ratio: float = 1.5  # ... and one whose sides differ more than this factor in length


@dataclass
class DataConfig:
    name: str = "copy"  # copy | multi30k | files | wmt14
    src_lang: str = "de"  # source language: the file suffix of the source side
    tgt_lang: str = "en"  # target language
    root: Optional[str] = None  # cache/download folder; None = $XDG_CACHE_HOME/transformer or ~/.cache/transformer
    # data=multi30k: files are fetched from URL/<file> into ROOT/multi30k (sha256-checked against the table in
    # transformer/data/download.py); a ROOT that already holds them is used offline.
    url: str = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
    download_retries: int = 4  # attempts per file, with exponential backoff (1 s, 2 s, 4 s, ...)
    download_timeout_s: float = 60.0  # connecting, and each network read
    download_deadline_s: Optional[float] = 3600.0  # one file, all attempts included; null: none
    # data=files: split name -> path prefix; files are PREFIX.SRC_LANG and PREFIX.TGT_LANG (optionally .gz)
    files: Dict[str, str] = field(default_factory=dict)
    train_split: str = "train"  # the split that trains (Multi30k file stem, or a key of data.files)
    valid_split: str = "val"  # the split that validates
    # Splits the evaluate command scores by default (Multi30k file stems, or keys of data.files).
    test_splits: List[str] = field(default_factory=list)
    max_tokens: int = 4096  # per worker per micro-batch, padding included
    # A ramp of batch sizes: epoch e < len uses entry e in place of max_tokens, later epochs max_tokens; [] = off
    max_tokens_by_epoch: List[int] = field(default_factory=list)
    max_sentences: Optional[int] = None  # also cap a micro-batch's sentences; None = tokens alone bound it
    max_len: int = 256  # tokens per side, after tokenisation
    bad_pairs: str = "skip"  # skip (logged count) | error (names the file and line): empty or over-length pairs
    num_workers: Optional[int] = None  # DataLoader workers; None = 2 on GPU, 0 on CPU
    # BPE-dropout (tokenizer=bpe): each training epoch segments words with merges dropped at this rate, from
    # bpe_dropout_samples segmentations drawn per distinct word (transformer/data/bpe_dropout.py); 0 = off.
    # Epochs before bpe_dropout_from_epoch train on the plain segmentation.
    bpe_dropout: float = 0.0
    bpe_dropout_samples: int = 8  # segmentations drawn per distinct word, once, with the seed
    bpe_dropout_from_epoch: int = 0  # the first epoch that trains on dropped merges
    # Preprocessed ids, keyed by a hash of data + tokenizer config; None = <user cache dir>/transformer/cache
    cache_dir: Optional[str] = None
    # A folder made by transformer-preprocess: train from it (memory-mapped; every node must see it) instead of
    # preprocessing data.* on the fly. Its tokenizer and filtering were fixed when it was made.
    preprocessed: Optional[str] = None
    copy: CopyConfig = field(default_factory=CopyConfig)
    wmt14: Wmt14Config = field(default_factory=Wmt14Config)


@dataclass
class TokenizerConfig:
    """Ids 0..3 are <pad> <unk> <s> </s> in every vocabulary (transformer/specials.py)."""
    # spacy (word-level, one vocabulary per language) | bpe (one shared subword vocabulary, HF tokenizers) |
    # sentencepiece (one shared unigram or BPE vocabulary, transformer/data/spm.py)
    name: str = "spacy"
    min_freq: int = 2  # spacy: words seen fewer times in train map to <unk>; bpe: least frequent merge kept
    max_vocab: Optional[int] = None  # spacy: keep at most this many words per language (specials included)
    lowercase: bool = False  # lowercase the text before tokenising and building the vocabulary
    vocab_size: int = 10000  # bpe, sentencepiece: shared source+target vocabulary size (specials included)
    # bpe, sentencepiece: learn from at most this many training sentences (source and target lines count alike),
    # drawn at random with `seed`; null = all. Encoding always covers the whole corpus.
    train_sample: Optional[int] = 1_000_000
    # bpe: full = the target side may use every type of the shared vocabulary; seen = only the types the
    # training targets use, numbered first (the output layer computes those logits only; a type seen only
    # in a held-out reference encodes as <unk> there). transformer/data/tokenizer.py seen_targets_first.
    tgt_vocab: str = "full"
    # sentencepiece: an existing .model file instead of training one (its specials are renumbered to ids 0..3
    # if they sit elsewhere); null = train on the training split (vocab_size, train_sample, seed, the keys below)
    model_file: Optional[str] = None
    model_type: str = "unigram"  # sentencepiece: unigram | bpe
    character_coverage: float = 1.0  # sentencepiece: share of the training characters kept; rarer ones are <unk>
    byte_fallback: bool = False  # sentencepiece: characters outside the vocabulary become UTF-8 byte pieces
    # sentencepiece: training threads; the learnt model depends on this number (not on the machine)
    train_threads: int = 4


@dataclass
class PreprocessOptions:
    """How `transformer-preprocess` runs; none of these change the folder it writes."""
    out_dir: str = MISSING  # the folder to write (created; `transformer-train data.preprocessed=OUT_DIR` reads it)
    workers: Optional[int] = None  # encoding processes; None = every CPU this process may use
    chunk_size: int = 10000  # pairs read, encoded and written at a time: peak memory grows with it, not the corpus
    overwrite: bool = False  # replace an existing out_dir (the old one stays until the new one is complete)
    progress: bool = True  # progress bars on stderr


@dataclass
class PreprocessConfig:
    """conf/preprocess.yaml: the data and tokenizer groups of transformer-train, plus `preprocess`."""
    data: DataConfig = MISSING
    tokenizer: TokenizerConfig = MISSING
    preprocess: PreprocessOptions = field(default_factory=PreprocessOptions)
    seed: int = 1234  # draws the BPE/SentencePiece training sample (tokenizer.train_sample)


def register_preprocess_configs() -> None:
    """conf/preprocess.yaml lists `preprocess_schema` first, so every group merges into its typed node."""
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="preprocess_schema", node=PreprocessConfig)
