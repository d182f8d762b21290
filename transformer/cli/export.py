"""`transformer-export CHECKPOINT --to hf|ctranslate2 --out DIR`: the trained model for other tools.

    transformer-export best.pt --to hf --out model-hf                       # transformers: MarianMTModel
    transformer-export best.pt --to ctranslate2 --out model-ct2 --quantization int8

The folder appears complete or not at all (written beside it, then renamed). What the target format cannot
hold is refused with one `error:` line (exit 2). Needs the `export` extra (transformers, ctranslate2,
safetensors).
"""
import argparse
import sys

from transformer.cli.common import UsageError, run_command
from transformer.training.components.checkpoint import load_model

PROG = "transformer-export"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Export a checkpoint to a Hugging Face MarianMTModel "
                                                       "folder or a CTranslate2 model folder.")
    p.add_argument("checkpoint", help="checkpoint file (e.g. RUN_DIR/checkpoints/best.pt)")
    p.add_argument("--to", required=True, choices=["hf", "ctranslate2"], help="target format")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument("--quantization", choices=["int8", "int8_float16", "float16"],
                   help="ctranslate2 only: weight type (default: float32)")
    return p


def _library(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise UsageError(f"--to needs the Python package {name}: pip install 'transformer[export]'") from None


def run(args: argparse.Namespace) -> int:
    if args.quantization and args.to != "ctranslate2":
        raise UsageError(f"--quantization {args.quantization}: only with --to ctranslate2")
    if args.to == "hf":
        _library("transformers")
        _library("safetensors")
        from transformers.utils import logging as hf_logging

        from transformer.interop.hf import export_hf
        hf_logging.disable_progress_bar()
        model, tokenizer, ckpt = load_model(args.checkpoint)
        out = export_hf(model, tokenizer, ckpt, args.out)
    else:
        _library("ctranslate2")
        from transformer.interop.ct2 import export_ct2
        model, tokenizer, _ = load_model(args.checkpoint)
        out = export_ct2(model, tokenizer, args.out, args.quantization)
    print(f"{PROG}: {args.checkpoint} -> {out} ({args.to}{', ' + args.quantization if args.quantization else ''})",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
