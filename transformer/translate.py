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
from typing import Iterator, List, Optional, TextIO

import torch

from transformer.atomic import atomic_open
from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.config import EvalConfig
from transformer.decode import translate_sentences

PROG = "transformer-translate"


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 1."""


def add_decoding_args(parser: argparse.ArgumentParser, default_beam: Optional[int] = 5) -> None:
    g = parser.add_argument_group("decoding (defaults: the checkpoint's eval config, beam 5)")
    g.add_argument("--beam", type=int, default=default_beam, help="beam size; 1 = greedy (default: %(default)s)")
    g.add_argument("--lenpen", type=float, help="length penalty: hypotheses rank by logprob / length**lenpen")
    g.add_argument("--max-len-a", type=float, help="output limit a * source_length + b: the a")
    g.add_argument("--max-len-b", type=int, help="output limit a * source_length + b: the b")
    g.add_argument("--nbest", type=int, help="hypotheses written per sentence")
    g.add_argument("--batch-tokens", type=int, help="source tokens per batch, padding included")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's choice)")


def eval_config(args: argparse.Namespace, ckpt: dict) -> EvalConfig:
    """The checkpoint's `eval` settings with the command-line options on top."""
    saved = dict((ckpt.get("config") or {}).get("eval") or {})
    known = EvalConfig.__dataclass_fields__
    cfg = EvalConfig(**{k: v for k, v in saved.items() if k in known})
    for key in ("beam", "lenpen", "max_len_a", "max_len_b", "nbest", "batch_tokens"):
        value = getattr(args, key)
        if value is not None:
            setattr(cfg, key, value)
    if args.nbest is None:
        cfg.nbest = min(cfg.nbest, cfg.beam)
    if cfg.beam < 1:
        raise UsageError(f"--beam {cfg.beam}: must be >= 1")
    if not 1 <= cfg.nbest <= cfg.beam:
        raise UsageError(f"--nbest {cfg.nbest}: must be between 1 and --beam ({cfg.beam})")
    if cfg.batch_tokens < 1:
        raise UsageError(f"--batch-tokens {cfg.batch_tokens}: must be >= 1")
    return cfg


def pick_device(name: str, threads: Optional[int] = None) -> torch.device:
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads {threads}: must be >= 1")
        torch.set_num_threads(threads)
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load(path, device: torch.device):
    """(model in eval mode, tokenizer, checkpoint dict); a bad file raises UsageError."""
    from transformer.data.tokenizer import tokenizer_from_state
    from transformer.model import from_args

    try:
        ckpt = load_checkpoint(path)
        tokenizer = tokenizer_from_state(ckpt["tokenizer"])
        model = from_args(ckpt["model_args"])
        model.load_state_dict(ckpt["model"])
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    except (KeyError, ValueError, RuntimeError) as e:  # not our layout, or weights that do not fit model_args
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path}: broken checkpoint ({type(e).__name__}: {first})") from None
    return model.to(device).eval(), tokenizer, ckpt


def read_chunks(stream: TextIO, size: Optional[int], name: str) -> Iterator[List[str]]:
    """Lines (without line ends) in lists of `size` (None: everything at once)."""
    chunk, number = [], 0
    while True:
        try:
            line = stream.readline()
        except UnicodeDecodeError as e:
            raise UsageError(f"{name}, line {number + 1}: invalid UTF-8 ({e.reason})") from None
        if not line:
            break
        number += 1
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


def translate_stream(model, tokenizer, cfg: EvalConfig, device, src: TextIO, out: TextIO, buffer_size: Optional[int],
                     src_name: str = "<stdin>") -> int:
    """Translates `src` to `out` chunk by chunk, flushing after each; returns the number of sentences."""
    done = 0
    for chunk in read_chunks(src, buffer_size, src_name):
        keep = [i for i, s in enumerate(chunk) if s.strip()]
        hyps = translate_sentences(model, tokenizer, [chunk[i] for i in keep], cfg, device)
        by_line = dict(zip(keep, hyps))
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
    add_decoding_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run(args: argparse.Namespace) -> int:
    if args.buffer_size is not None and args.buffer_size < 1:
        raise UsageError(f"--buffer-size {args.buffer_size}: must be >= 1")
    if args.input and not Path(args.input).is_file():
        raise UsageError(f"--input {args.input}: no such file")
    device = pick_device(args.device, args.threads)
    model, tokenizer, ckpt = load(args.checkpoint, device)
    cfg = eval_config(args, ckpt)
    for stream in (sys.stdin, sys.stdout):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8")
    src = open(args.input, encoding="utf-8") if args.input else sys.stdin
    interactive = args.interactive or (not args.input and sys.stdin.isatty())
    buffer_size = args.buffer_size or (1 if interactive else 10000)
    start = time.perf_counter()
    try:
        if args.output:
            with output_file(Path(args.output)) as out:
                n = translate_stream(model, tokenizer, cfg, device, src, out, buffer_size, args.input or "<stdin>")
        else:
            n = translate_stream(model, tokenizer, cfg, device, src, sys.stdout, buffer_size,
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
