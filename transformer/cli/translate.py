"""`transformer-translate CHECKPOINT`: translate sentences (one per line) from stdin or a file.

    echo "Ein Mann fährt Fahrrad ." | transformer-translate outputs/run/checkpoints/best.pt
    transformer-translate best.pt --input test.de --output test.hyp.en --beam 5

Lines are read in chunks (`--buffer-size`), each chunk is batched by length and written back in input
order. At a terminal (or with `--interactive`) every line is translated as soon as it is typed. The
checkpoint alone is enough: it carries the architecture, the weights and the tokenizer.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import BinaryIO, Iterator, List, Optional, TextIO

from transformer.atomic import atomic_open
from transformer.cli.common import UsageError, add_decoding_args, eval_config, pick_device, run_command
from transformer.config import EvalConfig
from transformer.data.tokenizer import encode_sources
from transformer.decoding import translate_ids
from transformer.training.checkpoint import load_model

PROG = "transformer-translate"



def read_chunks(stream: BinaryIO, size: Optional[int], name: str) -> Iterator[List[str]]:
    """Lines (without line ends) in lists of `size` (None: everything at once). Each line is decoded on its
    own, so invalid UTF-8 is reported with its own line number."""
    chunk, number = [], 0
    for raw in iter(stream.readline, b""):
        number += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"{name}, line {number}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
        chunk.append(line.rstrip("\n").rstrip("\r"))
        if size is not None and len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def format_output(hyps, index: int, nbest: int) -> List[str]:
    """One line per sentence; with n-best, Moses format `index ||| text ||| score` per hypothesis."""
    if nbest == 1:
        return [hyps[0].text]
    return [f"{index} ||| {h.text} ||| {h.score:.4f}" for h in hyps]


def translate_stream(model, tokenizer, cfg: EvalConfig, device, src: BinaryIO, out: TextIO,
                     buffer_size: Optional[int], max_source_tokens: int, src_name: str = "<stdin>") -> int:
    """Translates `src` to `out` chunk by chunk, flushing after each; returns the number of sentences."""
    done = 0
    for chunk in read_chunks(src, buffer_size, src_name):
        keep = [i for i, s in enumerate(chunk) if s.strip()]
        ids = encode_sources(tokenizer, [chunk[i] for i in keep])
        for k, i in enumerate(keep):
            if len(ids[k]) > max_source_tokens:
                print(f"{PROG}: warning: {src_name}, line {done + i + 1}: {len(ids[k])} source tokens, truncated to "
                      f"{max_source_tokens} (--max-source-tokens)", file=sys.stderr)
                ids[k] = ids[k][:max_source_tokens]
        by_line = dict(zip(keep, translate_ids(model, tokenizer, ids, cfg, device), strict=False))
        for i in range(len(chunk)):
            if i in by_line:
                out.write("\n".join(format_output(by_line[i], done + i, cfg.nbest)) + "\n")
            else:  # an empty line stays empty, so output line k still answers input line k
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
    p.add_argument("--max-source-tokens", type=int, default=None,
                   help="longer sources are truncated, with a warning (default: the checkpoint's data.max_len, the "
                        "longest sentence training kept; outputs are also bounded by the model's max_positions)")
    add_decoding_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    if args.buffer_size is not None and args.buffer_size < 1:
        raise UsageError(f"--buffer-size {args.buffer_size}: must be >= 1")
    if args.input and not Path(args.input).is_file():
        raise UsageError(f"--input {args.input}: no such file")
    device = pick_device(args.device, args.threads)
    model, tokenizer, ckpt = load_model(args.checkpoint, device)
    cfg = eval_config(args, ckpt)
    trained_max = ((ckpt.get("config") or {}).get("data") or {}).get("max_len") or model.args.max_positions
    max_source = trained_max if args.max_source_tokens is None else args.max_source_tokens
    if max_source < 1:
        raise UsageError(f"--max-source-tokens {max_source}: must be >= 1")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")
    src = open(args.input, "rb") if args.input else sys.stdin.buffer
    interactive = args.interactive or (not args.input and sys.stdin.isatty())
    buffer_size = args.buffer_size or (1 if interactive else 10000)
    start = time.perf_counter()
    try:
        if args.output:
            with output_file(Path(args.output)) as out:
                n = translate_stream(model, tokenizer, cfg, device, src, out, buffer_size, max_source,
                                     args.input or "<stdin>")
        else:
            n = translate_stream(model, tokenizer, cfg, device, src, sys.stdout, buffer_size, max_source,
                                 args.input or "<stdin>")
    finally:
        if args.input:
            src.close()
    if args.output:
        seconds = time.perf_counter() - start
        print(f"{PROG}: {n} sentences in {seconds:.1f}s -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
