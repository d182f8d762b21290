"""`transformer-evaluate CHECKPOINT`: translate test sets and score them with sacreBLEU (BLEU and chrF).

    transformer-evaluate RUN/checkpoints/best.pt --split test_2016_flickr --data-root /data
    transformer-evaluate best.pt --src test.de --ref test.en --beam 5 --out-dir results/

Splits are read with the data settings stored in the checkpoint (`data.name`, languages, `data.files`),
`--data-root` replacing `data.root`. A data root, given here or stored in the checkpoint, is a dataset
folder and only read: a split missing there is an error. Only the default cache (no data root at all) is
downloaded into. For each split NAME, OUT_DIR/NAME.hyp holds the detokenised
hypotheses (line k for source line k) and OUT_DIR/NAME.json the scores with sacreBLEU's signatures;
OUT_DIR defaults to RUN/eval/ for a checkpoint under RUN/checkpoints/. Text is read and translated as
transformer-translate reads and translates it (transformer/data/textfile.py; a blank source line gets an
empty hypothesis, scored as it is), so the scores are those of `transformer-translate --input SRC | sacrebleu REF`.
`--backend ctranslate2` decodes with CTranslate2 instead (transformer/interop/backend.py, docs/interop.md).
"""
import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from transformer.atomic import write_text_atomic
from transformer.cli.common import (
    UsageError,
    add_decoding_args,
    eval_config,
    max_source_tokens,
    pick_device,
    run_command,
    translate_lines,
)
from transformer.interop.backend import decoder_for, require_ctranslate2
from transformer.training.components.checkpoint import load_model

PROG = "transformer-evaluate"


def score(hyps: List[str], refs: List[str]) -> dict:
    """Corpus BLEU and chrF with sacreBLEU's defaults (13a tokenisation, exp smoothing; chrF2)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "bleu_str": str(b), "bleu_signature": str(bleu.get_signature()),
            "chrf": c.score, "chrf_str": str(c), "chrf_signature": str(chrf.get_signature())}


def default_out_dir(checkpoint: Path) -> Path:
    checkpoint = checkpoint.resolve()
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "eval"
    return checkpoint.parent / "eval"


def read_text(path: str, flag: str) -> List[str]:
    """The lines of --src/--ref by the rules of transformer/data/textfile.py; any readable path (a pipe too)."""
    from transformer.data.textfile import check_readable, read_lines

    try:
        check_readable(path, f"{flag} {path}")
        return read_lines(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def data_config(ckpt: dict, data_root: Optional[str]):
    """The checkpoint's full config (typed), with `data.root` replaced by --data-root."""
    from transformer.config import from_container

    saved = ckpt.get("config")
    if not saved or "data" not in saved:
        raise UsageError("the checkpoint carries no data config: use --src FILE --ref FILE")
    try:
        cfg = from_container(saved)
    except Exception as e:  # a config from an incompatible version of the schema
        raise UsageError(f"cannot read the checkpoint's config ({str(e).splitlines()[0]}): use --src/--ref") from None
    if data_root is not None:
        cfg.data.root = str(Path(data_root).expanduser())
    return cfg


def load_splits(args, ckpt: Optional[dict]) -> List[Tuple[str, List[str], List[str]]]:
    """(name, sources, references) of every requested split (--src/--ref need no checkpoint)."""
    if args.src or args.ref:
        if not (args.src and args.ref):
            raise UsageError("--src and --ref go together")
        srcs, refs = read_text(args.src, "--src"), read_text(args.ref, "--ref")
        if len(srcs) != len(refs):
            raise UsageError(f"--src {args.src} has {len(srcs)} lines but --ref {args.ref} has {len(refs)}")
        return [(Path(args.src).name, srcs, refs)]
    from transformer.data.translation import load_split

    cfg = data_config(ckpt, args.data_root)
    # Only the default cache is ever downloaded into; a folder the user named is a dataset, only read.
    download = cfg.data.root is None
    out = []
    for name in args.split:
        try:
            srcs, refs = load_split(cfg, name, progress=False, download=download, root_key="--data-root")
        except (ValueError, OSError) as e:
            raise UsageError(f"--split {name}: {e}") from None
        out.append((name, srcs, refs))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Translate test sets and score them with sacreBLEU.")
    p.add_argument("checkpoint", help="checkpoint file (e.g. RUN_DIR/checkpoints/best.pt)")
    p.add_argument("--split", action="append", default=[],
                   help="split name of the checkpoint's dataset, e.g. test_2016_flickr (repeatable)")
    p.add_argument("--src", help="source file, one sentence per line (instead of --split)")
    p.add_argument("--ref", help="reference file aligned with --src")
    p.add_argument("--data-root", help="replaces the checkpoint's data.root: a folder holding the dataset's "
                   "files, only read (never downloaded into)")
    p.add_argument("--out-dir", help="where NAME.hyp and NAME.json go (default: RUN_DIR/eval)")
    add_decoding_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    if bool(args.split) == bool(args.src or args.ref):
        raise UsageError("give --split NAME (repeatable) or --src FILE --ref FILE")
    # --src/--ref are read before the checkpoint is loaded: a bad file fails fast (and a pipe is drained once)
    splits = load_splits(args, None) if args.src or args.ref else None
    if args.backend == "ctranslate2":
        require_ctranslate2()  # before the checkpoint is loaded: a missing library fails fast
    device = pick_device("cpu" if args.backend == "ctranslate2" else args.device, args.threads)
    model, tokenizer, ckpt = load_model(args.checkpoint, device)
    cfg = eval_config(args, ckpt)
    cfg.nbest = 1
    max_source = max_source_tokens(args, ckpt, model)
    decode = decoder_for(args.backend, args.checkpoint, model, tokenizer, args.threads)
    splits = splits or load_splits(args, ckpt)
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(Path(args.checkpoint))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {out_dir}: {e.strerror}") from None
    for name, srcs, refs in splits:
        start = time.perf_counter()
        # The same path as transformer-translate's: a blank source line gets an empty hypothesis, still scored
        nbests = translate_lines(PROG, model, tokenizer, srcs, cfg, device, max_source, name, decode=decode)
        hyps = [n[0].text if n is not None else "" for n in nbests]
        seconds = time.perf_counter() - start
        result = {"split": name, "checkpoint": str(Path(args.checkpoint).resolve()),
                  "step": (ckpt.get("trainer") or {}).get("step"), "sentences": len(srcs),
                  **score(hyps, refs), "beam": cfg.beam, "lenpen": cfg.lenpen, "max_len_a": cfg.max_len_a,
                  "max_len_b": cfg.max_len_b, "backend": args.backend, "device": str(device),
                  "seconds": round(seconds, 3), "sentences_per_s": round(len(srcs) / max(seconds, 1e-9), 2)}
        write_text_atomic(out_dir / f"{name}.hyp", "".join(h + "\n" for h in hyps))
        write_text_atomic(out_dir / f"{name}.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        print(f"{name}: {result['bleu_str']}  ({result['bleu_signature']})")
        print(f"{name}: {result['chrf_str']}  ({result['chrf_signature']})")
        print(f"{name}: {len(srcs)} sentences in {seconds:.1f}s, beam {cfg.beam}; hypotheses in "
              f"{out_dir / (name + '.hyp')}, scores in {out_dir / (name + '.json')}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
