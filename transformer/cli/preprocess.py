"""`transformer-preprocess` / `python -m transformer.cli.preprocess`: tokenise and binarise a corpus once.

    transformer-preprocess [data=... tokenizer=... KEY=VALUE ...] preprocess.out_dir=DIR

The same `data=` / `tokenizer=` groups and overrides as transformer-train (Hydra's compose API on
conf/preprocess.yaml), then `transformer-train data.preprocessed=DIR` trains from the folder on any number
of workers and nodes. Exit codes: 0 done, 2 bad input (one `error:` line; nothing written), 130 interrupted.
Spawned encoding workers import this module again: its top level stays free of heavy imports.
"""
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from transformer import exit_codes

USAGE = """usage: transformer-preprocess [GROUP=OPTION ...] [KEY=VALUE ...] preprocess.out_dir=DIR

Tokenises and binarises the train and valid splits of a corpus into DIR, in bounded memory and in parallel
(the output is the same for any number of workers); then: transformer-train data.preprocessed=DIR ...

groups:   data=multi30k|files|wmt14   tokenizer=spacy|bpe|sentencepiece   (as for transformer-train)
keys:     preprocess.out_dir (required), preprocess.workers (default: all CPUs), preprocess.chunk_size (10000
          pairs), preprocess.overwrite (false), preprocess.progress (true), seed (draws the BPE/SentencePiece sample),
          tokenizer.train_sample (BPE/SentencePiece: sentences learnt from, default 1000000), data.* as for
          transformer-train
example:  transformer-preprocess data=wmt14 tokenizer=bpe tokenizer.vocab_size=37000 preprocess.out_dir=wmt14-bin
exit:     0 done, 2 bad input (one `error:` line, nothing written), 5 a full disk or read-only file system
          (one `error:` line, nothing written), 130 interrupted"""


def compose(overrides: List[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from transformer.config import CONF_DIR
    from transformer.data.config import register_preprocess_configs
    register_preprocess_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="preprocess", overrides=overrides)
    from omegaconf import OmegaConf
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # a missing key fails here, named in full
    return cfg


def peak_rss_mb() -> Optional[float]:
    """This process's peak resident memory (VmHWM; getrusage's maxrss would carry a spawning parent's over)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def run(cfg) -> dict:
    from transformer.data.preprocess import Options
    from transformer.data.translation import preprocess_corpus

    p = cfg.preprocess
    workers = p.workers if p.workers is not None else len(os.sched_getaffinity(0))
    if cfg.data.max_len < 1:
        raise ValueError(f"data.max_len={cfg.data.max_len}: must be >= 1")
    if cfg.data.name == "copy":
        raise ValueError("data.name='copy': the copy task is generated, not preprocessed (data=multi30k, files "
                         "or wmt14)")
    t0 = time.time()
    out = preprocess_corpus(cfg, Path(p.out_dir).expanduser(), Options(workers, p.chunk_size, p.overwrite, p.progress))
    from transformer.data.store import Preprocessed
    m = Preprocessed(out, verify="size").manifest
    return {"out_dir": str(out), "seconds": time.time() - t0, "manifest": m, "workers": workers,
            "peak_rss_mb": peak_rss_mb()}


def summary(result: dict) -> str:
    m, rss = result["manifest"], result["peak_rss_mb"]
    train, valid = m["splits"]["train"], m["splits"]["valid"]
    size = sum(f["bytes"] for f in m["files"].values()) / 2**20
    skipped = sum(train["skipped"].values())
    return (f"{result['out_dir']}: {train['pairs']} train pairs ({skipped} skipped), {valid['pairs']} valid, "
            f"{train['tokens']['src']}+{train['tokens']['tgt']} train tokens as {m['dtypes']['tokens']}, vocab "
            f"{m['vocab']['src']}/{m['vocab']['tgt']}, {size:.1f} MiB | {result['seconds']:.1f} s with "
            f"{result['workers']} worker process(es) | peak RSS of the main process "
            f"{'n/a' if rss is None else f'{rss:.0f} MB'}\n"
            f"train from it: transformer-train data.preprocessed={result['out_dir']} "
            f"data.src_lang={m['src_lang']} data.tgt_lang={m['tgt_lang']} ...")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    # HF tokenizers may use every core in this process (BPE training; encoding with one worker): encoding
    # workers are spawned, not forked, and turn it off for themselves (transformer/data/encode.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from transformer.cli.compose import one_line
    from transformer.data.download import DownloadError
    from transformer.environment import describe, machine_error
    cfg = None
    try:
        cfg = compose(argv)
        result = run(cfg)
    except (HydraException, OmegaConfBaseException, DownloadError, FileNotFoundError, ValueError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        machine = machine_error(e)  # a full disk: the staging folder is gone again, nothing half-written left
        if machine is None:
            raise
        out = Path(cfg.preprocess.out_dir).expanduser() if cfg is not None and cfg.preprocess.out_dir else None
        print(f"error: {describe(machine, None, out)}", file=sys.stderr)
        return exit_codes.ENVIRONMENT
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
