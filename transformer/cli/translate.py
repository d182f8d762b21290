"""`transformer-translate CHECKPOINT`: translate sentences (one per line) from stdin or a file.

    echo "Ein Mann fährt Fahrrad ." | transformer-translate outputs/run/checkpoints/best.pt
    transformer-translate best.pt --input test.de --output test.hyp.en --beam 5

Lines are read in chunks (`--buffer-size`) by the rules of transformer/data/textfile.py (`--input` may be any
readable path: a pipe, /dev/stdin, `<(zcat test.de.gz)`), each chunk is batched by length and written back in
input order; a blank line stays blank. At a terminal (or with `--interactive`) every line is translated as soon
as it is typed. The checkpoint alone is enough: it carries the architecture, the weights and the tokenizer.
`--backend ctranslate2` decodes with CTranslate2 instead (transformer/interop/backend.py, docs/interop.md).
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Iterator, List, TextIO

from transformer.atomic import atomic_open
from transformer.cli.common import (
    UsageError,
    add_decoding_args,
    eval_config,
    max_source_tokens,
    pick_device,
    run_command,
    translate_lines,
)
from transformer.config import EvalConfig
from transformer.data.textfile import Source, check_readable, iter_lines
from transformer.interop.backend import decoder_for, require_ctranslate2
from transformer.training.components.checkpoint import load_model

PROG = "transformer-translate"


def read_chunks(src: Source, size: int, name: str) -> Iterator[List[str]]:
    """Lines in lists of `size`, read by the rules of transformer/data/textfile.py (an empty input is no error:
    it has no translation); a bad byte is a usage error naming the line."""
    lines = iter_lines(src, size, name, empty_ok=True)
    while True:
        try:
            chunk = next(lines)
        except StopIteration:
            return
        except ValueError as e:
            raise UsageError(str(e)) from None
        yield chunk


def format_output(hyps, index: int, nbest: int) -> List[str]:
    """One line per sentence; with n-best, Moses format `index ||| text ||| score` per hypothesis."""
    if nbest == 1:
        return [hyps[0].text]
    return [f"{index} ||| {h.text} ||| {h.score:.4f}" for h in hyps]


def translate_stream(model, tokenizer, cfg: EvalConfig, device, src: Source, out: TextIO,
                     buffer_size: int, max_source_tokens: int, src_name: str = "<stdin>", decode=None) -> int:
    """Translates `src` (a path or a binary stream) to `out` chunk by chunk, flushing after each; returns the
    number of lines. `decode`: as translate_lines takes it (None: the torch decoder)."""
    done = 0
    for chunk in read_chunks(src, buffer_size, src_name):
        nbests = translate_lines(PROG, model, tokenizer, chunk, cfg, device, max_source_tokens, src_name, done + 1,
                                 decode)
        for i, nbest in enumerate(nbests):
            if nbest is not None:
                out.write("\n".join(format_output(nbest, done + i, cfg.nbest)) + "\n")
            else:  # a blank line stays blank, so output line k still answers input line k
                out.write("\n" if cfg.nbest == 1 else f"{done + i} |||  ||| 0.0000\n")
        out.flush()
        done += len(chunk)
    return done


def output_file(path: Path):
    """--output, written atomically (it appears only once complete); a bad path is a usage error first."""
    if path.is_dir():
        raise UsageError(f"--output {path}: is a folder")
    if not path.parent.is_dir():
        raise UsageError(f"--output {path}: folder {path.parent} does not exist")
    return atomic_open(path, "w", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Translate one sentence per line with a trained checkpoint.")
    p.add_argument("checkpoint", help="checkpoint file (e.g. RUN_DIR/checkpoints/best.pt)")
    p.add_argument("--input", help="source text file, one sentence per line (default: stdin)")
    p.add_argument("--output", help="where translations go, line k for input line k (default: stdout)")
    p.add_argument("--interactive", action="store_true",
                   help="translate every line as soon as it is read (the default when stdin is a terminal)")
    p.add_argument("--buffer-size", type=int, default=None,
                   help="lines read before translating a batch (default 1 interactively, else 10000)")
    add_decoding_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    if args.buffer_size is not None and args.buffer_size < 1:
        raise UsageError(f"--buffer-size {args.buffer_size}: must be >= 1")
    if args.input:  # any readable path: a file, a named pipe, /dev/stdin, <(zcat test.de.gz)
        try:
            check_readable(args.input, f"--input {args.input}")
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.backend == "ctranslate2":
        require_ctranslate2()  # before the checkpoint is loaded: a missing library fails fast
    device = pick_device("cpu" if args.backend == "ctranslate2" else args.device, args.threads)
    model, tokenizer, ckpt = load_model(args.checkpoint, device)
    cfg = eval_config(args, ckpt)
    max_source = max_source_tokens(args, ckpt, model)
    decode = decoder_for(args.backend, args.checkpoint, model, tokenizer, args.threads)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")
    src = args.input or sys.stdin.buffer
    interactive = args.interactive or (not args.input and sys.stdin.isatty())
    buffer_size = args.buffer_size or (1 if interactive else 10000)
    name = args.input or "<stdin>"
    start = time.perf_counter()
    if args.output:
        with output_file(Path(args.output)) as out:
            n = translate_stream(model, tokenizer, cfg, device, src, out, buffer_size, max_source, name, decode)
        seconds = time.perf_counter() - start
        print(f"{PROG}: {n} sentences in {seconds:.1f}s -> {args.output}", file=sys.stderr)
    else:
        translate_stream(model, tokenizer, cfg, device, src, sys.stdout, buffer_size, max_source, name, decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
